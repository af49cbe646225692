"""argparse ``type=`` functions with ranges for the tools/ scripts: a bad number is one line
``error: argument --tp: ...`` and exit code 2 (argparse's), never a traceback later on."""

import argparse
import math


def int_range(lo=None, hi=None):
    """An ``int`` type that accepts ``lo <= value <= hi`` (either bound optional)."""

    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(
                f"{value} is out of range: must be " + _limits(lo, hi, ">=")
            )
        return value

    parse.__name__ = "int"
    return parse


def float_range(lo=None, hi=None, lo_open=False):
    """A finite ``float`` type that accepts ``lo <(=) value <= hi`` (``lo_open``: ``> lo``)."""

    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        low_bad = lo is not None and (value <= lo if lo_open else value < lo)
        if not math.isfinite(value) or low_bad or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(
                f"{text} is out of range: must be a finite number"
                + (" " if lo is not None or hi is not None else "")
                + _limits(lo, hi, ">" if lo_open else ">=")
            )
        return value

    parse.__name__ = "float"
    return parse


def _limits(lo, hi, lo_op):
    return " and ".join(
        ([f"{lo_op} {lo}"] if lo is not None else []) + ([f"<= {hi}"] if hi is not None else [])
    )
