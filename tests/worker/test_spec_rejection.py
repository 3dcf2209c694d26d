"""The rejection sampler: greedy acceptance, -1 padding with different draft lengths per request, the emitted
tokens' distribution equal to p (chi-square) for random p and q (q far from p too) and one-hot drafts, and seeded
draws that do not depend on the batch."""
from __future__ import annotations

import pytest
import torch

from backend_lib.core.sampling_params import SamplingParams
from backend_lib.worker.sampler import Sampler, SamplingMetadata, SamplingRow
from backend_lib.worker.spec_decode.rejection import DraftLayout, num_accepted, rejection_sample

V = 12


def rows_for(drafts: list[list[int]], seeds: list[int], **params) -> list[SamplingRow]:
    out = []
    for d, seed in zip(drafts, seeds):
        for j in range(len(d) + 1):
            out.append(SamplingRow(params=SamplingParams(**params), seed=seed, output_position=5 + j,
                                   prompt_token_ids=[1], output_token_ids=[]))
    return out


def run(logits: torch.Tensor, drafts: list[list[int]], seeds: list[int], draft_probs=None, **params) -> torch.Tensor:
    meta = SamplingMetadata.build(rows_for(drafts, seeds, **params), logits.shape[-1], "cpu")
    return rejection_sample(logits, DraftLayout.build(drafts, "cpu"), meta, draft_probs).token_ids


def test_greedy_accepts_while_equal_to_argmax_and_pads():
    torch.manual_seed(0)
    drafts = [[3, 5, 7], [], [1], [4, 4]]
    logits = torch.randn(sum(len(d) + 1 for d in drafts), V)
    logits[0, 3] = logits[1, 5] = 50.0  # request 0: drafts 1 and 2 are the argmax, draft 3 is not
    logits[2, 7] = -50.0
    logits[7, 4] = logits[8, 4] = 50.0  # request 3: both drafts accepted -> bonus from row 9
    logits[5, 1] = -50.0  # request 2: its draft is rejected
    out = run(logits, drafts, [0] * 4, temperature=0.0)
    argmax = logits.argmax(-1).tolist()
    assert out.tolist() == [[3, 5, argmax[2], -1],
                            [argmax[4], -1, -1, -1],  # no drafts: the bonus token only
                            [argmax[5], -1, -1, -1],  # rejected: the recovered token
                            [4, 4, argmax[9], -1]]
    assert num_accepted(out).tolist() == [2, 0, 0, 2]


def test_all_accepted_emits_bonus_and_no_drafts_equals_plain_sampler():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    drafts = [[int(logits[0].argmax()), int(logits[1].argmax())]]
    out = run(logits, drafts, [0], temperature=0.0)
    assert out[0].tolist() == drafts[0] + [int(logits[2].argmax())]
    # No drafts, sampled rows: exactly the plain sampler's draw at the same (seed, position).
    batch = torch.randn(6, V, generator=torch.Generator().manual_seed(2)) * 2
    out = run(batch, [[]] * 6, list(range(100, 106)), temperature=0.8, top_k=6)
    plain_rows = [SamplingRow(params=SamplingParams(temperature=0.8, top_k=6), seed=100 + b, output_position=5,
                              prompt_token_ids=[1], output_token_ids=[]) for b in range(6)]
    plain = Sampler()(batch, SamplingMetadata.build(plain_rows, V, "cpu")).token_ids
    assert out[:, 0].tolist() == plain.tolist()


def _random_dist(gen: torch.Generator, sharp: float) -> torch.Tensor:
    return torch.softmax(torch.randn(V, generator=gen) * sharp, dim=-1)


@pytest.mark.parametrize("num_drafts,q_kind", [(1, "near"), (3, "far"), (4, "onehot"), (2, "random")])
def test_emitted_tokens_follow_target_distribution(num_drafts, q_kind):
    from scipy.stats import chisquare
    gen = torch.Generator().manual_seed(10 + num_drafts)
    p = [_random_dist(gen, 1.0) for _ in range(num_drafts + 1)]
    if q_kind == "near":
        q = [torch.softmax(torch.log(pj) + 0.3 * torch.randn(V, generator=gen), -1) for pj in p[:-1]]
    elif q_kind == "far":  # mass where p has little: most drafts get rejected
        q = [torch.softmax(-4 * torch.log(pj), -1) for pj in p[:-1]]
    else:
        q = [_random_dist(gen, 2.0) for _ in p[:-1]]
    trials = 6000
    if q_kind == "onehot":
        drafts = torch.randint(0, V, (trials, num_drafts), generator=gen)
        draft_probs = None
    else:
        drafts = torch.stack([torch.multinomial(qj, trials, replacement=True, generator=gen) for qj in q], dim=1)
        qrow = torch.stack(q + [torch.zeros(V)])  # the bonus row's q is ignored
        draft_probs = qrow.repeat(trials, 1)
    logits = torch.log(torch.stack(p)).repeat(trials, 1)
    out = run(logits, drafts.tolist(), list(range(trials)), draft_probs, temperature=1.0)
    for j in range(num_drafts + 1):
        reached = out[:, j][out[:, j] >= 0]
        if reached.numel() < 300:  # a far q rarely gets this deep; the first positions are always tested
            assert j >= 2, (j, reached.numel())
            continue
        counts = torch.bincount(reached, minlength=V).double()
        expected = p[j].double() / p[j].double().sum() * reached.numel()
        assert chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-3, (j, q_kind)
    if q_kind == "far":  # the far q really is rejected most of the time
        assert (num_accepted(out) == 0).double().mean() > 0.5


def test_seeded_draws_do_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(4, V, generator=gen)
    q = torch.softmax(torch.randn(4, V, generator=gen), -1)
    drafts = [[2, 9, 4]]
    alone = run(logits, drafts, [77], q, temperature=0.9)
    other = torch.randn(5, V, generator=gen)
    mixed = run(torch.cat([other[:2], logits, other[2:]]), [[1], drafts[0], [3, 3]], [5, 77, 6],
                torch.cat([torch.softmax(other[:2], -1), q, torch.softmax(other[2:], -1)]), temperature=0.9)
    assert mixed[1].tolist() == alone[0].tolist()
    again = run(logits, drafts, [78], q, temperature=0.9)
    runs = {tuple(run(logits, drafts, [s], q, temperature=0.9)[0].tolist()) for s in range(40)}
    assert len(runs) > 1 and again.shape == alone.shape
