"""grpo/algorithm/aggregation.py: token weights from batch-wide counts, so micro-batches sum to the batch loss."""
import pytest
import torch

from grpo.algorithm.aggregation import BatchCounts, token_weights

MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])  # lengths 3 and 1
COUNTS = BatchCounts(num_seqs=2, num_tokens=4, max_len=4)


@pytest.mark.parametrize("agg,first,second", [("token_mean", 1 / 4, 1 / 4), ("seq_mean_token_mean", 1 / 6, 1 / 2),
                                              ("seq_mean_token_sum", 1 / 2, 1 / 2), ("dr_grpo", 1 / 8, 1 / 8)])
def test_each_aggregation_weighs_the_tokens_it_says(agg, first, second):
    w = token_weights(MASK, agg, COUNTS)
    assert w[0, 0].item() == pytest.approx(first) and w[1, 0].item() == pytest.approx(second)
    assert (w * (1 - MASK)).abs().sum() == 0  # padding weighs nothing


def test_micro_batches_with_batch_counts_sum_to_the_whole_batch():
    loss = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0]])
    whole = (loss * token_weights(MASK, "seq_mean_token_mean", COUNTS)).sum()
    parts = sum((loss[i:i + 1] * token_weights(MASK[i:i + 1], "seq_mean_token_mean", COUNTS)).sum() for i in (0, 1))
    assert float(parts) == pytest.approx(float(whole)) == pytest.approx((2.0 + 4.0) / 2)
    with pytest.raises(ValueError, match="loss_agg"):
        token_weights(MASK, "mean", COUNTS)


@pytest.mark.parametrize("agg,weight", [("token_mean", 1.0), ("seq_mean_token_mean", 1.0),
                                        ("seq_mean_token_sum", 1.0), ("dr_grpo", 1 / 4)])
def test_a_batch_of_one_token_in_one_sequence_weighs_it_by_the_counts_alone(agg, weight):
    """The counts' floor of 1 (an empty batch) must not touch a batch of exactly one."""
    w = token_weights(torch.tensor([[1.0, 0.0]]), agg, BatchCounts(num_seqs=1, num_tokens=1, max_len=4))
    assert w.tolist() == [[pytest.approx(weight), 0.0]]
