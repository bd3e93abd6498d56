"""Integer helpers shared by the block accounting and the weight slicing."""


def cdiv(a: int, b: int) -> int:
    """a / b rounded up (for non-negative a, positive b)."""
    return -(-a // b)
