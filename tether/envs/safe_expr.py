"""Gatekeepers for answers that a third-party checker would `eval`.

Some reasoning-gym checkers call `eval(answer)` or `sympy.parse_expr(answer)` (which evals too) on the
model's text, in the trainer's process. Rather than trust them, an answer reaches such a checker only if
its Python syntax tree is a plain literal, or arithmetic over single-letter variables and a fixed list
of math functions: no attribute access, subscripts, strings, comprehensions or other calls, and no
power towers or huge exponents that would hang the process. Pure: nothing here evaluates anything.
"""

from __future__ import annotations

import ast

MAX_CHARS = 2000
MAX_EXPONENT = 100
FUNCTIONS = frozenset(
    {"sin", "cos", "tan", "cot", "sec", "csc", "asin", "acos", "atan", "sinh", "cosh", "tanh"}
    | {"exp", "log", "ln", "sqrt", "Abs", "abs"}
)
CONSTANTS = frozenset({"pi", "E", "I", "oo"})
_ARITHMETIC = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Pow, ast.USub, ast.UAdd)


def _tree(text: str) -> ast.Expression | None:
    if len(text) > MAX_CHARS:
        return None
    try:
        return ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _number(node: ast.AST) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        node = node.operand
    return isinstance(node, ast.Constant) and type(node.value) in (int, float)


def is_literal(text: str) -> bool:
    """A number, string, bool or None, or lists and tuples of them: what `ast.literal_eval` reads."""
    tree = _tree(text)
    if tree is None:
        return False
    for node in ast.walk(tree.body):
        if isinstance(node, ast.List | ast.Tuple | ast.Load | ast.USub | ast.UAdd):
            continue
        if isinstance(node, ast.Constant) and type(node.value) in (int, float, str, bool, type(None)):
            continue
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd) and _number(node):
            continue
        return False
    return True


def _bound(node: ast.AST) -> float:
    """An upper bound of the magnitude a numeric part of an exponent can take (a variable counts as 1)."""
    if _number(node):
        return abs(float(ast.literal_eval(node)))
    if isinstance(node, ast.Name):
        return 1.0
    if isinstance(node, ast.UnaryOp):
        return _bound(node.operand)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub):
        return _bound(node.left) + _bound(node.right)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        return _bound(node.left) * _bound(node.right)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        divisor = abs(float(ast.literal_eval(node.right))) if _number(node.right) else 1.0
        return _bound(node.left) / divisor if divisor else float("inf")
    if isinstance(node, ast.Call):
        return 1.0 if all(_bound(arg) <= MAX_EXPONENT for arg in node.args) else float("inf")
    return float("inf")  # powers inside exponents and anything else: refused


def _pow_depth(node: ast.AST) -> int:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        return 1 + _pow_depth(node.left)
    if isinstance(node, ast.UnaryOp):
        return _pow_depth(node.operand)
    return 0


def is_arithmetic(text: str) -> bool:
    """Numbers, single-letter variables, `pi`/`E`/`I`/`oo`, + - * / and small powers, and math functions."""
    tree = _tree(text)
    if tree is None:
        return False
    for node in ast.walk(tree.body):
        if isinstance(node, ast.BinOp):
            if not isinstance(node.op, _ARITHMETIC):
                return False
            # sympy evaluates numeric powers exactly: 9**9**9 or (2**99)**99**... would never finish.
            if isinstance(node.op, ast.Pow) and (_bound(node.right) > MAX_EXPONENT or _pow_depth(node) > 2):
                return False
        elif isinstance(node, ast.UnaryOp):
            if not isinstance(node.op, _ARITHMETIC):
                return False
        elif isinstance(node, ast.Call):
            if not (isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS) or node.keywords:
                return False
        elif isinstance(node, ast.Name):
            if not (len(node.id) == 1 and node.id.isascii() and node.id.isalpha()) and node.id not in (
                FUNCTIONS | CONSTANTS
            ):
                return False
        elif isinstance(node, ast.Constant):
            if type(node.value) not in (int, float):
                return False
        elif not isinstance(node, ast.Load | ast.operator | ast.unaryop):
            return False
    return True
