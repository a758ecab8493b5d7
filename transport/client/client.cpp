// Placeholder translation unit; the client library lands here.
