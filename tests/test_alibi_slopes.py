"""ALiBi's head slopes follow Press et al. (arXiv:2108.12409): 2^(−8h/H) for H a power of two; otherwise the slopes
of the largest power of two H' < H, then every other slope of 2H' heads.

The expected values below are written out by hand from that rule, as exponents of 2."""
import numpy as np
import pytest

import jaxpe


def powers_of_two(*exponents: float) -> np.ndarray:
    return 2.0 ** -np.asarray(exponents, np.float64)


# H' = 2^⌊log2 H⌋ slopes 2^(−8h/H'), then 2^(−8h/(2H')) for h = 1, 3, 5, ... (every other slope of 2H' heads).
NON_POWERS = {
    3: powers_of_two(4, 8, 2),  # H' = 2: 2^-4, 2^-8; 4 heads: 2^-2, 2^-4, 2^-6, 2^-8 -> 2^-2
    5: powers_of_two(2, 4, 6, 8, 1),  # H' = 4; 8 heads: 2^-1, 2^-2, ... -> 2^-1
    6: powers_of_two(2, 4, 6, 8, 1, 3),  # H' = 4; 8 heads -> 2^-1, 2^-3
    12: powers_of_two(1, 2, 3, 4, 5, 6, 7, 8, 0.5, 1.5, 2.5, 3.5),  # H' = 8; 16 heads: 2^-0.5, 2^-1, ... -> odd ones
}
POWERS = {
    1: powers_of_two(8),
    2: powers_of_two(4, 8),
    4: powers_of_two(2, 4, 6, 8),
    8: powers_of_two(1, 2, 3, 4, 5, 6, 7, 8),
    16: powers_of_two(0.5, 1, 1.5, 2, 2.5, 3, 3.5, 4, 4.5, 5, 5.5, 6, 6.5, 7, 7.5, 8),
}


@pytest.mark.parametrize("num_heads", sorted(NON_POWERS))
def test_slopes_of_a_head_count_that_is_not_a_power_of_two(num_heads):
    slopes = np.asarray(jaxpe.alibi_slopes(num_heads))
    assert slopes.dtype == np.float32 and slopes.shape == (num_heads,)
    np.testing.assert_allclose(slopes, NON_POWERS[num_heads], rtol=1e-6)


@pytest.mark.parametrize("num_heads", sorted(POWERS))
def test_slopes_of_a_power_of_two_are_the_geometric_sequence(num_heads):
    np.testing.assert_allclose(jaxpe.alibi_slopes(num_heads), POWERS[num_heads], rtol=1e-6)


def test_the_bias_uses_the_slopes_of_each_head():
    bias = np.asarray(jaxpe.alibi_bias(np.arange(3)[None], 3, 3))  # [1, H=3, Lq, Lk], slopes 2^-4, 2^-8, 2^-2
    distance = np.arange(3)[:, None] - np.arange(3)[None, :]
    for head, slope in enumerate((2.0 ** -4, 2.0 ** -8, 2.0 ** -2)):
        np.testing.assert_allclose(bias[0, head], -slope * distance, rtol=1e-6)


@pytest.mark.parametrize("num_heads", [0, -2, 2.0, True, "4"])
def test_a_bad_head_count_is_refused(num_heads):
    with pytest.raises(ValueError, match="num_heads"):
        jaxpe.alibi_slopes(num_heads)
