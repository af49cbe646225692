"""Corrupt a file in place for the checkpoint-integrity tests."""


def flip(path, n=64):
    """XOR ``n`` bytes in the middle of ``path``: same size, different content."""
    size = path.stat().st_size
    off = max(0, size // 2 - n // 2)
    with open(path, "r+b") as f:
        f.seek(off)
        data = f.read(n)
        f.seek(off)
        f.write(bytes(b ^ 0xFF for b in data))
    assert path.stat().st_size == size
    return path
