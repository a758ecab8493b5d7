#pragma once
/// Python str operations the Jinja filters and methods share (jinja_builtins.cpp). Case
/// mapping is ASCII-only; whitespace is ASCII whitespace plus \x1c-\x1f, as str.split sees it
/// in the ASCII range.
#include <string>
#include <string_view>
#include <vector>

namespace tandem::jinja {

bool py_space(char c);
/// str.strip/lstrip/rstrip; `chars` null = whitespace. `left`/`right` say which ends.
std::string py_strip(std::string_view s, const std::string* chars, bool left, bool right);
std::string py_lower(std::string_view s);
std::string py_upper(std::string_view s);
/// str.capitalize: first character upper, the rest lower.
std::string py_capitalize(std::string_view s);
/// str.title: each run of letters starts upper, continues lower.
std::string py_title(std::string_view s);
/// str.split(sep, maxsplit); `sep` null = runs of whitespace. Empty sep: error.
std::vector<std::string> py_split(std::string_view s, const std::string* sep, long maxsplit);
/// str.replace(old, new, count); count < 0 = all. `max_bytes` bounds the result.
std::string py_replace(std::string_view s, std::string_view old, std::string_view repl, long count, size_t max_bytes);

/// markupsafe.escape: & < > " ' as entities.
std::string html_escape(std::string_view s);

}  // namespace tandem::jinja
