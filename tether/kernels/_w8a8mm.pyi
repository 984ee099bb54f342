def matmul(
    x: int,
    w: int,
    scale: int,
    bias: int,
    out: int,
    m: int,
    n: int,
    k: int,
    threads: int,
    path: int,
) -> None: ...
def supports(path: int) -> bool: ...
