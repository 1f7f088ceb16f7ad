"""γ and Γ as physics writes them (the Lorentz factor, the adiabatic index, a decay width): math-verify's LaTeX parser
reads a bare ``\\gamma`` as the gamma function applied to whatever follows (``\\gamma-1`` is gamma(-1), infinite),
reads ``2\\gamma`` as 2 and fails on ``\\gamma=``, ``\\gamma^2``; Gym's physics judge then asks an LLM, we have none."""

from __future__ import annotations

import pytest

from nemo_gym_prorl.envs.math.env import grade_answer

LORENTZ = r"1/\sqrt{1-v^2/c^2}"
KINETIC = r"(\gamma - 1) m c^2"


@pytest.mark.parametrize(
    ("answer", "expected", "reward"),
    [
        (r"\boxed{\gamma=\frac{1}{\sqrt{1-v^2/c^2}}}", LORENTZ, 1.0),  # Gym's physics row's own solution
        (r"The factor is $\gamma=\frac{1}{\sqrt{1-v^2/c^2}}$.", rf"\boxed{{{LORENTZ}}}", 1.0),
        (r"\boxed{(\gamma-1)mc^2}", KINETIC, 1.0),
        (r"\boxed{\gamma m c^2 - m c^2}", KINETIC, 1.0),
        (r"\boxed{(\gamma+1)mc^2}", KINETIC, 0.0),
        (r"\boxed{\gamma m c^2}", KINETIC, 0.0),
        (r"\boxed{\gamma^2 - 1}", r"(\gamma-1)(\gamma+1)", 1.0),
        (r"\boxed{\beta\gamma c}", r"\gamma\beta c", 1.0),
        (r"\boxed{\frac{\hbar}{2}\Gamma}", r"\hbar\Gamma/2", 1.0),
        (r"\boxed{0.5772156649}", r"\gamma", 1.0),  # Euler's constant still
        (r"\boxed{\Gamma(5)}", "24", 1.0),  # and a call still the gamma function
        (r"\boxed{\gamma_0 = 2}", "2", 1.0),
    ],
)
def test_gamma_is_read_as_a_value_not_as_the_gamma_function(answer: str, expected: str, reward: float) -> None:
    assert grade_answer(answer, expected).reward == reward
