// The Jinja interpreter (transport/chat/jinja.h): expressions, filters, tests, whitespace
// control as jinja2 does it with trim_blocks/lstrip_blocks, and errors and limits.
#include <doctest/doctest.h>

#include "transport/chat/jinja.h"

using namespace tandem;

namespace {

std::string render(std::string_view src, std::string_view ctx_json = "{}", jinja::limits lim = {}) {
  jinja::environment env;
  env.now = [] { return std::time_t{1721995200}; };
  return jinja::template_(src, lim).render(jinja::from_json(ctx_json), env);
}

/// The error kind and message of rendering `src`, or "" if it renders.
std::pair<std::string, std::string> fails(std::string_view src, std::string_view ctx_json = "{}", jinja::limits lim = {}) {
  try {
    render(src, ctx_json, lim);
  } catch (const jinja::error& e) {
    return {std::string(jinja::to_string(e.kind())), e.what()};
  }
  return {"", ""};
}

}  // namespace

TEST_CASE("jinja: literals, arithmetic, comparisons and python's str of values") {
  CHECK(render("{{ 1 + 2 * 3 }}|{{ 7 // 2 }}|{{ -7 // 2 }}|{{ -7 % 3 }}|{{ 7 / 2 }}|{{ 2 ** 10 }}") == "7|3|-4|2|3.5|1024");
  CHECK(render("{{ 'a' ~ 1 ~ none }}|{{ 'ab' * 3 }}|{{ [1] + [2] }}|{{ (1, 'x') }}|{{ (1,) }}") == "a1None|ababab|[1, 2]|(1, 'x')|(1,)");
  CHECK(render("{{ {'a': [true, none, 1.5, \"it's\"]} }}") == "{'a': [True, None, 1.5, \"it's\"]}");
  CHECK(render("{{ 1e-5 }} {{ 1e16 }} {{ 0.1 + 0.2 }} {{ 3.0 }} {{ 1 == 1.0 }} {{ true == 1 }}") ==
        "1e-05 1e+16 0.30000000000000004 3.0 True True");
  CHECK(render("{{ 1 < 2 < 3 }} {{ 'b' > 'a' }} {{ [1, 2] < [1, 3] }} {{ 'x' in 'xyz' }} {{ 2 not in [1] }} {{ 'k' in {'k': 1} }}") ==
        "True True True True True True");
  CHECK(render("{{ 'yes' if x else 'no' }}|{{ 'yes' if y }}|{{ x and 'a' or 'b' }}|{{ not x }}", R"({"x": 0})") == "no||b|True");
  CHECK(render("{{ 'abcdef'[1:3] }}|{{ 'abcdef'[::-1] }}|{{ [1,2,3,4][-2:] }}|{{ 'héllo'[1] }}|{{ 'héllo'[:2] }}") ==
        "bc|fedcba|[3, 4]|é|hé");
  CHECK(render("{{ x.a.b }}|{{ x['a']['b'] }}|{{ x.missing }}|{{ l[5] }}|{{ l[-1] }}", R"({"x": {"a": {"b": 7}}, "l": [1, 2]})") ==
        "7|7|||2");
}

TEST_CASE("jinja: statements - if, for with loop variables and else, set, namespace, macros, filter blocks") {
  CHECK(render("{% for x in xs %}{{ loop.index }}{{ x }}{% if not loop.last %},{% endif %}{% endfor %}", R"({"xs": ["a","b","c"]})") ==
        "1a,2b,3c");
  CHECK(render("{% for x in [] %}x{% else %}empty{% endfor %}") == "empty");
  CHECK(render("{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}", R"({"d": {"b": 1, "a": 2}})") == "b=1;a=2;");
  CHECK(render("{% for x in [1,2,3,4] if x is even %}{{ x }}{{ loop.length }}{% endfor %}") == "2242");
  CHECK(render("{% for x in [1,2,3] %}{% if x == 2 %}{% break %}{% endif %}{{ x }}{% endfor %}") == "1");
  CHECK(render("{% for x in [1,2,3] %}{% if x == 2 %}{% continue %}{% endif %}{{ x }}{% endfor %}") == "13");
  CHECK(render("{% for x in [1,2,3] %}{{ loop.previtem }}-{{ loop.nextitem }}/{% endfor %}") == "-2/1-3/2-/");
  CHECK(render("{% set x = 1 %}{% for i in [1] %}{% set x = 2 %}{% endfor %}{{ x }}") == "1");
  CHECK(render("{% set ns = namespace(x=1) %}{% for i in [1,2] %}{% set ns.x = ns.x + i %}{% endfor %}{{ ns.x }}") == "4");
  CHECK(render("{% set a, b = [1, 2] %}{{ b }}{{ a }}") == "21");
  CHECK(render("{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}{{ greet('A') }} {{ greet('B', punct='?') }}") ==
        "Hi A! Hi B?");
  CHECK(render("{% macro f(n) %}{% if n > 0 %}{{ n }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(3) }}") == "321");
  CHECK(render("{% filter upper %}abc{% endfilter %}|{% set s %} x {% endset %}[{{ s }}]|{% set t | trim %} y {% endset %}[{{ t }}]") ==
        "ABC|[ x ]|[y]");
  CHECK(render("{% if a %}1{% elif b %}2{% else %}3{% endif %}", R"({"a": false, "b": true})") == "2");
  CHECK(render("{# a comment #}x") == "x");
}

TEST_CASE("jinja: whitespace control as jinja2 with trim_blocks and lstrip_blocks") {
  CHECK(render("  {% if true %}\n    x\n  {% endif %}\ny") == "    x\ny");
  CHECK(render("a  {{- ' b ' -}}  c") == "a b c");
  CHECK(render("a\n  {%- if true %} b{% endif %}") == "a b");
  CHECK(render("a\n  {%+ if true %}b{% endif %}") == "a\n  b");
  CHECK(render("x\n  {# c #}\ny") == "x\ny");
  CHECK(render("{{ 'a' }}\n{{ 'b' }}\n") == "a\nb");  // one trailing newline dropped, none after }}
  CHECK(render("a\r\nb") == "a\nb");
}

TEST_CASE("jinja: filters and tests used by chat templates") {
  CHECK(render("{{ '  x  ' | trim }}|{{ 'aBc' | upper }}|{{ 'aBc' | lower }}|{{ 'hello world' | title }}|{{ 'hELLO' | capitalize }}") ==
        "x|ABC|abc|Hello World|Hello");
  CHECK(render("{{ [1, 2] | length }}|{{ 'héllo' | length }}|{{ {'a': 1} | length }}|{{ x | default('d') }}|{{ [3, 1] | join('-') }}") ==
        "2|5|1|d|3-1");
  CHECK(render("{{ [1, 2, 3] | first }}{{ [1, 2, 3] | last }}|{{ 'a-b' | replace('-', '+') }}|{{ '42' | int + 1 }}|{{ 3 | string }}") ==
        "13|a+b|43|3");
  CHECK(render("{{ d | tojson }}", R"({"d": {"a": [1, 2.5, "é\n\"", null, true]}})") == R"({"a": [1, 2.5, "é\n\"", null, true]})");
  CHECK(render("{{ d | tojson(indent=2) }}", R"({"d": {"a": [1], "b": {}}})") == "{\n  \"a\": [\n    1\n  ],\n  \"b\": {}\n}");
  CHECK(render("{{ 'a\nb\n' | indent(2) }}|{{ 'a\nb' | indent(2, first=true) }}") == "a\n  b\n|  a\n  b");
  CHECK(render("{{ xs | selectattr('t', 'equalto', 'x') | map(attribute='n') | list }}",
               R"({"xs": [{"t": "x", "n": 1}, {"t": "y", "n": 2}, {"t": "x", "n": 3}]})") == "[1, 3]");
  CHECK(render("{{ xs | rejectattr('t', 'defined') | list | length }}|{{ ['a', 'B', 'A'] | unique | list }}|{{ [1, 2, 3] | reject('odd') | list }}",
               R"({"xs": [{"t": 1}, {}]})") == "1|['a', 'B']|[2]");
  CHECK(render("{{ d | dictsort }}|{{ d | items | list }}", R"({"d": {"b": 1, "A": 2}})") == "[('A', 2), ('b', 1)]|[('b', 1), ('A', 2)]");
  CHECK(render("{{ x is defined }}{{ y is defined }}{{ none is none }}{{ 's' is string }}{{ {} is mapping }}{{ [] is iterable }}"
               "{{ 1 is number }}{{ 's' is not string }}{{ 3 is odd }}",
               R"({"x": 1})") == "TrueFalseTrueTrueTrueTrueTrueFalseTrue");
  CHECK(render("{{ ' a b '.strip() }}|{{ 'a,b'.split(',') }}|{{ 'abc'.startswith('ab') }}|{{ 'abc'.endswith(('x', 'c')) }}|"
               "{{ d.get('k', 5) }}|{{ d.get('z') }}|{{ d.keys() | list }}|{{ 'x</think>y'.split('</think>')[-1] }}",
               R"({"d": {"z": null}})") == "a b|['a', 'b']|True|True|5|None|['z']|y");
  CHECK(render("{{ strftime_now('%d %b %Y') }}") == "26 Jul 2024");
  CHECK(render("{{ range(3) | list }}|{{ [1, 2] | map('string') | join }}") == "[0, 1, 2]|12");
}

TEST_CASE("jinja: errors name their kind, line and column") {
  auto [k1, m1] = fails("line one\n{{ raise_exception('no system role') }}");
  CHECK(k1 == "raised");
  CHECK(m1.find("no system role") != std::string::npos);
  CHECK(m1.find("line 2") != std::string::npos);
  auto [k2, m2] = fails("{% if x %}");
  CHECK(k2 == "syntax");
  CHECK(m2.find("endif") != std::string::npos);
  auto [k3, m3] = fails("\n\n  {{ 1 + }}");
  CHECK(k3 == "syntax");
  CHECK(m3.find("line 3") != std::string::npos);
  CHECK(fails("{{ x.y }}").first == "render");  // attribute of an undefined variable
  CHECK(fails("{{ 1 + 'a' }}").first == "render");
  CHECK(fails("{{ [1] | tojson }}{{ x | tojson }}").first == "render");
  CHECK(fails("{% set l = [] %}{{ l.append(1) }}").first == "render");  // the sandbox is immutable
  CHECK(fails("{{ 'x' | nosuchfilter }}").second.find("nosuchfilter") != std::string::npos);
  CHECK(fails("{% include 'x' %}").first == "syntax");
  CHECK(fails("{{ 'abc").first == "syntax");
}

TEST_CASE("jinja: limits stop runaway templates with a clear error") {
  jinja::limits small;
  small.max_steps = 10000;
  small.max_output_bytes = 1000;
  CHECK(fails("{% for i in range(100000) %}{% endfor %}", "{}", small).first == "limit");
  CHECK(fails("{% for i in range(500) %}xxxxx{% endfor %}", "{}", small).first == "limit");
  CHECK(fails("{{ 'x' * 100000 }}", "{}", small).first == "limit");
  CHECK(fails("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}").first == "limit");
  CHECK(fails("{{ " + std::string(1000, '(') + "1" + std::string(1000, ')') + " }}").first != "");
  CHECK(fails("{{ " + std::string(1000, '-') + "1 }}").first == "limit");
  CHECK(fails(std::string(1000, '{') + "% if 1 %}").first != "");
  CHECK(fails("{% set ns = namespace() %}{% set ns.self = ns %}{{ ns.self.self.self }}").first == "");
  CHECK(fails("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}").first == "limit");
  // Values that grow one level per iteration are stopped where a namespace stores them.
  CHECK(fails("{% set ns = namespace(l=[]) %}{% for i in range(100000) %}{% set ns.l = [ns.l] %}{% endfor %}").first == "limit");
  CHECK(fails("{% set ns = namespace(p=none) %}{% for i in range(50000) %}{% set ns.p = namespace(p=ns.p) %}{% endfor %}").first == "");
  jinja::limits tiny;
  tiny.max_template_bytes = 10;
  CHECK_THROWS_AS(jinja::template_("{{ 'more than ten bytes' }}", tiny), jinja::error);
}
