"""Code-writing environments: HumanEval and generated function families in Python, C and C++.

The model's code only ever runs in the sandbox; expected outputs of generated tasks stay on the host.
"""

from tether.envs.code.envs import FAMILIES, family_env, humaneval_env, register
from tether.envs.code.extract import CodeBlockParser
from tether.envs.code.families import Family, FunctionTask, Lang
from tether.envs.code.runner import CallOutcome, CheckVerdict, run_calls, run_check

__all__ = [
    "FAMILIES",
    "CallOutcome",
    "CheckVerdict",
    "CodeBlockParser",
    "Family",
    "FunctionTask",
    "Lang",
    "family_env",
    "humaneval_env",
    "register",
    "run_calls",
    "run_check",
]
