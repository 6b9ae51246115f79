"""The C++ exponential race (kernels/cpu_sampling.cpp): its distribution, its independence of the batch,
and its counter-based random numbers against the PyTorch twin and SplitMix64's published outputs; and the greedy
argmax against torch.argmax (its twin), ties, NaN and infinities included."""

import math

import pytest
import torch

from kernels.cpu_extension import cpu_kernels_available
from kernels.cpu_sampling import argmax_rows_cpu, exponential_race_cpu
from kernels.reference import exponential_race_reference, splitmix64_at

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="C++ CPU kernels unavailable")

# chi-square critical value for 4 degrees of freedom at p = 0.001
CHI2_CRIT_4_DOF = 18.47


def test_splitmix64_twin_matches_the_published_stream():
    # SplitMix64 seeded with 0: its first outputs (Vigna's reference implementation, splitmix64.c).
    first = splitmix64_at(torch.tensor([0, 0, 0]), torch.tensor([0, 1, 2])).tolist()
    expected = [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    assert [v & ((1 << 64) - 1) for v in first] == expected


def test_draws_follow_the_softmax():
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    num_draws = 20000
    logits = probs.log().expand(num_draws, -1).contiguous()
    keys = torch.full((num_draws,), 77, dtype=torch.long)
    tokens = exponential_race_cpu(logits, keys, torch.arange(num_draws))  # one key, counters 0 .. n-1
    counts = torch.bincount(tokens, minlength=5).double()
    expected = probs.double() * num_draws
    assert float(((counts - expected) ** 2 / expected).sum()) < CHI2_CRIT_4_DOF


def test_a_row_draws_the_same_token_whatever_shares_the_call():
    row = torch.randn(1, 5000, generator=torch.Generator().manual_seed(3))
    key, counter = torch.tensor([123456789]), torch.tensor([17])
    alone = exponential_race_cpu(row, key, counter).item()
    for neighbours in (1, 5, 33):
        others = torch.randn(neighbours, 5000, generator=torch.Generator().manual_seed(neighbours))
        logits = torch.cat([others, row]).contiguous()
        keys = torch.cat([torch.randint(-(2**62), 2**62, (neighbours,)), key])
        counters = torch.cat([torch.randint(0, 100, (neighbours,)), counter])
        assert exponential_race_cpu(logits, keys, counters)[-1].item() == alone


def test_pruned_tokens_never_win_and_excluded_ones_never_drawn():
    logits = torch.full((3000, 200), -math.inf)
    logits[:, 5] = 0.0
    logits[:, 150] = -21.0  # more than the noise's range below the best: can never win
    logits[:, 90] = -1.0
    tokens = exponential_race_cpu(logits, torch.arange(3000), torch.zeros(3000, dtype=torch.long))
    assert set(tokens.tolist()) == {5, 90}
    assert (
        tokens.tolist()
        == exponential_race_reference(logits, torch.arange(3000), torch.zeros(3000, dtype=torch.long)).tolist()
    )


def test_a_row_without_a_finite_logit_is_an_error():
    with pytest.raises(RuntimeError, match="no finite logit"):
        exponential_race_cpu(torch.full((1, 8), -math.inf), torch.tensor([1]), torch.tensor([0]))


@pytest.mark.parametrize("width", [1, 7, 16, 17, 33, 1000, 49152])
def test_argmax_rows_matches_torch_argmax(width):
    gen = torch.Generator().manual_seed(width)
    logits = torch.randn(9, width, generator=gen)
    # ties: the maximum repeated later in the row (the lowest index wins), in the vector body and the tail
    logits[1, width // 2 :] = 0.0
    logits[1, : width // 2] = -1.0
    logits[2] = logits[2].round()  # many equal values
    logits[3] = -math.inf
    logits[4, -1] = math.inf
    logits[5, width // 3] = math.nan  # a NaN is the maximum, as torch.argmax has it
    logits[6, -1] = math.nan
    logits[6, 0] = math.inf
    logits[7] = -0.0
    logits[7, -1] = 0.0  # equal to -0.0: index 0 wins
    logits[8] = torch.finfo(torch.float32).min
    assert torch.equal(argmax_rows_cpu(logits), logits.argmax(dim=-1))


def test_argmax_rows_reads_strided_rows_and_no_rows():
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(5, 300, generator=gen)
    rows = wide[:, 40:240]  # row stride 300, unit stride inside
    assert torch.equal(argmax_rows_cpu(rows), rows.argmax(dim=-1))
    assert argmax_rows_cpu(torch.empty(0, 10)).shape == (0,)
    with pytest.raises(RuntimeError):
        argmax_rows_cpu(torch.randn(4, 8, dtype=torch.float64))
