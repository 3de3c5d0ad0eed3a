"""Input checks of jaxpe's public entry points. The checks of arrays and sizes live at the bottom layer,
`jaxpe.kernels._checks`, shared with the kernels (one wording everywhere), and are re-exported here; the choice of
implementation is jaxpe's own."""
from __future__ import annotations

from jaxpe.kernels._checks import (check_cope_inputs, check_corope_inputs, check_even_head_dim, check_float,
                                   check_npos, check_padding_mask, check_pos_emb, check_positive, check_qkv,
                                   check_rank, check_segment_ids, check_window)

__all__ = ["IMPLS", "check_cope_inputs", "check_corope_inputs", "check_even_head_dim", "check_float", "check_impl",
           "check_npos", "check_padding_mask", "check_pos_emb", "check_positive", "check_qkv", "check_rank",
           "check_segment_ids", "check_window"]

IMPLS = ("auto", "reference", "blockwise", "pallas")


def check_impl(impl: str) -> None:
    """Raise ValueError unless `impl` names an implementation."""
    if impl not in IMPLS:
        raise ValueError(f"{impl=} must be one of {IMPLS}")
