"""The generated driver that calls a C or C++ answer's function on hidden inputs in the sandbox.

The answer is compiled together with a `main` written here: it reads the hidden inputs from stdin,
calls the function, and prints one `NONCE INDEX VALUE` line per test. Expected values stay on the host.
An answer that defines its own `main` fails to link, which is the point: the task is a function.
Values cross as text: integers in decimal, booleans as 0/1, lists as `n x1 .. xn`, strings as
`length bytes` on the way in and `x<hex>` on the way out.
"""

from __future__ import annotations

from typing import Any

from tether.envs.code.families import FunctionTask, Lang
from tether.envs.context import ScoringContext
from tether.envs.sandboxed import capped_spec, framed_lines, new_nonce

RUN_TIMEOUT_S = 5.0  # the run step (compiling has its own limit); every test together, frames flushed
C_HEADER = (
    "#include <stdio.h>\n#include <stdlib.h>\n#include <string.h>\n#include <stdint.h>\n#include <limits.h>\n"
)
# A few headers only: every one costs compile time on each answer (<bits/stdc++.h> about 1.5 s);
# answers include what else they need.
CPP_INCLUDES = ("algorithm", "cstdio", "cstdlib", "string", "vector")
CPP_HEADER = "".join(f"#include <{name}>\n" for name in CPP_INCLUDES) + "using namespace std;\n"

_C_READERS = """
static long long tether_read_int(void) {
    long long v;
    if (scanf("%lld", &v) != 1) exit(3);
    return v;
}
static int *tether_read_list(int *n) {
    *n = (int)tether_read_int();
    int *a = (int *)malloc(sizeof(int) * (size_t)(*n + 1));
    for (int i = 0; i < *n; i++) a[i] = (int)tether_read_int();
    return a;
}
"""

_CPP_READERS = """
static long long tether_read_int() {
    long long v;
    if (scanf("%lld", &v) != 1) exit(3);
    return v;
}
static vector<int> tether_read_list() {
    int n = (int)tether_read_int();
    vector<int> a(n);
    for (int i = 0; i < n; i++) a[i] = (int)tether_read_int();
    return a;
}
static string tether_read_string() {
    long long n = tether_read_int();
    if (getchar() != ' ') exit(3);
    string s(n, '\\0');
    if (n > 0 && fread(&s[0], 1, (size_t)n, stdin) != (size_t)n) exit(3);
    return s;
}
static void tether_print(const string &s) {
    putchar('x');
    for (unsigned char c : s) printf("%02x", c);
}
static void tether_print(const vector<int> &a) {
    printf("%zu", a.size());
    for (int x : a) printf(" %d", x);
}
static void tether_print(long long v) { printf("%lld", v); }
static void tether_print(bool v) { printf("%d", v ? 1 : 0); }
"""


def driver(task: FunctionTask, language: Lang) -> str:
    """The `main` that feeds the hidden inputs to `task.entry` and prints its results."""
    reads, args = [], []
    for index, kind in enumerate(task.arg_kinds):
        name = f"tether_a{index}"
        if kind == "int":
            reads.append(f"long long {name} = tether_read_int();")
            args.append(name)
        elif kind == "int_list" and language is Lang.C:
            reads.append(f"int {name}_n; int *{name} = tether_read_list(&{name}_n);")
            args.extend([name, f"{name}_n"])
        elif kind == "int_list":
            reads.append(f"vector<int> {name} = tether_read_list();")
            args.append(name)
        elif kind == "string" and language is Lang.CPP:
            reads.append(f"string {name} = tether_read_string();")
            args.append(name)
        else:
            raise ValueError(f"{task.entry}: argument kind {kind!r} is not supported in {language.value}")
    call = f"{task.entry}({', '.join(args)})"
    if language is Lang.C:
        if task.returns not in ("int", "bool"):
            raise ValueError(f"{task.entry}: C functions return int or bool, not {task.returns!r}")
        cast = "(long long)" if task.returns == "int" else "(long long)!!"
        show = f'printf("%s %lld %lld\\n", tether_nonce, tether_i, {cast}({call}));'
        frees = "".join(f" free(tether_a{i});" for i, k in enumerate(task.arg_kinds) if k == "int_list")
        readers = _C_READERS
    else:
        result_type = {"int": "long long", "bool": "bool", "string": "string", "int_list": "vector<int>"}
        show = (
            f"{result_type[task.returns]} tether_r = {call}; "
            "printf(\"%s %lld \", tether_nonce, tether_i); tether_print(tether_r); putchar('\\n');"
        )
        frees, readers = "", _CPP_READERS
    body = " ".join(reads)
    return (
        f"{readers}\nint main(void) {{\n"
        "    char tether_nonce[64];\n"
        '    if (scanf("%63s", tether_nonce) != 1) return 3;\n'
        "    long long tether_count = tether_read_int();\n"
        "    for (long long tether_i = 0; tether_i < tether_count; tether_i++) {\n"
        f"        {body}\n        {show}\n        fflush(stdout);{frees}\n"
        "    }\n    return 0;\n}\n"
    )


def program(task: FunctionTask, language: Lang, answer: str) -> str:
    header = C_HEADER if language is Lang.C else CPP_HEADER
    return f'{header}\n#line 1 "answer"\n{answer}\n#line 1 "driver"\n{driver(task, language)}'


def encode_inputs(task: FunctionTask, nonce: str) -> str:
    parts = [nonce, str(len(task.calls))]
    for args in task.calls:
        for kind, value in zip(task.arg_kinds, args, strict=True):
            if kind == "int":
                parts.append(str(value))
            elif kind == "int_list":
                parts.append(" ".join(str(x) for x in [len(value), *value]))
            else:
                parts.append(f"{len(value.encode())} {value}")
    return " ".join(parts) + "\n"


def render_value(kind: str, value: Any) -> str:
    """How the driver prints `value` (used for the expected values, on the host)."""
    if kind == "bool":
        return "1" if value else "0"
    if kind == "string":
        return "x" + str(value).encode().hex()
    if kind == "int_list":
        return " ".join(str(x) for x in [len(value), *value])
    return str(value)


async def run_native(ctx: ScoringContext, task: FunctionTask, language: Lang, answer: str) -> list[bool]:
    """Compile `answer` with the driver, run every hidden test, and say which ones matched."""
    nonce = new_nonce()
    spec = await capped_spec(ctx, RUN_TIMEOUT_S)
    stdin = encode_inputs(task, nonce)
    result = await ctx.run(program(task, language, answer), language.value, stdin=stdin, spec=spec)
    got: dict[int, list[str]] = {}
    for line in framed_lines(result.stdout, nonce):
        index, _, value = line.partition(" ")
        if index.isdigit():
            got.setdefault(int(index), []).append(value.strip())
    return [got.get(i) == [render_value(task.returns, expected)] for i, expected in enumerate(task.expected)]
