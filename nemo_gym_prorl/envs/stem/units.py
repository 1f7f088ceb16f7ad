"""Numeric answers with units: parse into a pint quantity, compare after conversion within a relative tolerance.

Reads what models and datasets write: plain and scientific notation (``6.67e-11``, ``3.0\\times10^{8}``,
``3 \\cdot 10^8``, ``2.5×10^-3``), units in LaTeX (``\\text{m/s}``, ``\\mathrm{kg\\,m^{2}}``, ``\\frac{m}{s^2}``,
``^\\circ C``, ``\\Omega``, ``\\mu s``) or plain (``m/s``, ``kg*m^2``, ``°C``, ``%``). Unlike math-verify, which
drops units and compares rounded numbers, a unit of another dimension is a wrong answer, and a right value in
other units of the same dimension is right (``9.8 m/s^2`` = ``980 cm/s^2``).
"""

from __future__ import annotations

import functools
import math
import re

import pint

_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_TIMES_TEN = re.compile(r"(" + _NUMBER + r")\s*(?:\\times|\\cdot|×|\*|·|x)\s*10\s*\^\s*\{?\s*([-+−]?\d+)\s*\}?")
_LEADING_NUMBER = re.compile(r"\s*(" + _NUMBER + r")\s*(.*)", re.DOTALL)
_LATEX_REPLACEMENTS = [  # in this order: degrees and exponents before the wrappers that may hold them
    (re.compile(r"\^\s*\{?\s*\\circ\s*\}?|\\circ|°"), " deg"),
    (re.compile(r"\\(?:,|;|:|!| |quad|qquad)|~"), " "),
    (re.compile(r"\^\s*\{([^{}]*)\}"), r"**(\1)"),
    (re.compile(r"\^"), "**"),
    (re.compile(r"\\(?:text|mathrm|mathit|operatorname|textrm|rm)\s*\{([^{}]*)\}"), r" \1 "),
    (re.compile(r"\\frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}"), r"(\1)/(\2)"),
    (re.compile(r"\\(?:cdot|times)|·|×"), "*"),
    (re.compile(r"\\%|%"), " percent"),
    (re.compile(r"\\Omega|Ω"), "ohm"),
    (re.compile(r"\\mu\s*|μ|µ"), "u"),
    (re.compile(r"\\AA|Å"), "angstrom"),
    (re.compile(r"−"), "-"),
    (re.compile(r"\\left|\\right|\$"), ""),
]
_TEMPERATURE = re.compile(r"\bdeg\s*([CFK])\b")
_EXPONENT = re.compile(r"\*\*\s*\(?\s*[-+]?\d+(?:\.\d+)?(?:\s*/\s*\d+)?\s*\)?")  # m**2, s**(-1), m**(1/2)
_ONE_OVER = re.compile(r"(?<![\w.)])\(?\s*1\s*\)?\s*/")  # 1/s, and (1)/(s) from \frac{1}{s}
_ARITHMETIC = re.compile(r"[\d+-]")


class UnitParseError(ValueError):
    """The text is not a number with an optional unit pint knows."""


@functools.cache
def _registry() -> pint.UnitRegistry:
    return pint.UnitRegistry(autoconvert_offset_to_baseunit=True)


def _normalize(text: str) -> str:
    text = text.strip().rstrip(".")
    text = _TIMES_TEN.sub(lambda m: f"{m.group(1)}e{m.group(2).replace('−', '-')}", text)
    for pattern, replacement in _LATEX_REPLACEMENTS:
        text = pattern.sub(replacement, text)
    text = _TEMPERATURE.sub(lambda m: {"C": "degC", "F": "degF", "K": "kelvin"}[m.group(1)], text)
    return " ".join(text.replace("{", "(").replace("}", ")").split())


def parse_quantity(text: str) -> pint.Quantity:
    """`text` as a quantity: a number first, then an optional unit. UnitParseError when it is not one."""
    match = _LEADING_NUMBER.fullmatch(_normalize(text))
    if match is None:
        raise UnitParseError(f"not a number with a unit: {text!r}")
    value, unit = float(match.group(1)), match.group(2).strip()
    if _is_arithmetic(unit):
        raise UnitParseError(f"not a number with a unit: {text!r} goes on with arithmetic ({unit!r})")
    registry = _registry()
    try:
        return registry.Quantity(value, registry.parse_units(unit) if unit else registry.dimensionless)
    except Exception as e:  # pint parses free text with Python's tokenizer: PintError, SyntaxError, TokenError, ...
        raise UnitParseError(f"unknown unit {unit!r} in {text!r}: {e}") from None


def _is_arithmetic(unit: str) -> bool:
    """Whether what follows the number holds a number or a sign outside an exponent (or a 1 over units).

    pint reads ``+ 1`` as a dimensionless unit and ``+ 1 J`` as joules, so ``10 + 1`` would be 10: such a reply is
    an expression for math-verify, or wrong, never the number it starts with."""
    return _ARITHMETIC.search(_ONE_OVER.sub("/", _EXPONENT.sub("", unit))) is not None


def compare_quantities(expected: pint.Quantity, got: pint.Quantity, rel_tol: float) -> str | None:
    """None when `got` equals `expected` within `rel_tol` after conversion; otherwise why not."""
    if expected.dimensionality != got.dimensionality:
        got_units = f"{got.units:~}" or "no unit"
        want_units = f"{expected.units:~}" or "no unit"
        return f"wrong unit: {got_units} ({got.dimensionality}), expected {want_units} ({expected.dimensionality})"
    value = got.to(expected.units).magnitude
    if math.isclose(value, expected.magnitude, rel_tol=rel_tol, abs_tol=0.0 if expected.magnitude else 1e-12):
        return None
    return f"{value:.6g} {expected.units:~} differs from {expected.magnitude:.6g} by more than {rel_tol:.2%}"
