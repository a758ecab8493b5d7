// Placeholder translation unit; the HTTP front end lands here.
