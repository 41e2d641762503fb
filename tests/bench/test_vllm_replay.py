"""The vLLM replay's batch: each step commits a row's longest matching draft prefix and one
more token, cut at the output's end as vLLM cuts it, and fills a finished row's hole with the
last row (vLLM's condense); the modeled time prices every verified token."""

from __future__ import annotations

from agentspec.bench.vllm_replay import Batch, Request


def oracle(k: int):
    """A proposer that drafts each row's true next ``k`` tokens (it sees the requests)."""

    def propose(rows, sampled, num, tokens):
        for i, (req, new) in enumerate(zip(rows, sampled, strict=True)):
            n = int(num[i])
            assert list(tokens[i, n - len(new) : n]) == new  # the row holds what was sampled
            assert list(tokens[i, : len(req.prompt)]) == req.prompt
        return [req.answer[len(req.out) : len(req.out) + k] for req in rows]

    return propose


def test_a_right_draft_of_k_commits_k_plus_one_tokens_a_step():
    batch = Batch(oracle(3), max_len=64, cost=(1.0, 0.5))
    req = Request("a", [1, 2], list(range(10, 20)))
    batch.run([req], streams=1)
    # The first step has no draft (1 token), then 4 a step: 1 + 4 + 4; the last step's draft
    # is the one token left, which that step commits as its own (nothing is accepted past
    # the output's end).
    assert req.out == req.answer and req.steps == 4 and req.accepted == 6
    # Modeled: every step costs 1.0 plus 0.5 per verified token (its row's one and the draft).
    assert batch.seconds == 4 * 1.0 + 0.5 * (4 + 3 + 3 + 1)


def test_a_wrong_draft_commits_one_token_and_rows_are_condensed():
    def wrong(rows, sampled, num, tokens):
        return [[-1] for _ in rows]

    batch = Batch(wrong, max_len=64, cost=(1.0, 0.0))
    reqs = [Request("a", [1], [5, 6]), Request("b", [2], [7, 8, 9, 10]), Request("c", [3], [4])]
    batch.run(reqs, streams=2)
    assert [r.out for r in reqs] == [r.answer for r in reqs]
    assert [r.steps for r in reqs] == [2, 4, 1] and sum(r.accepted for r in reqs) == 0
    # A variant that must be caught: the oracle's drafts are accepted, these are not.
    right = Batch(oracle(8), max_len=64, cost=(1.0, 0.0))
    again = [Request(r.rid, r.prompt, r.answer) for r in reqs]
    right.run(again, streams=2)
    assert [r.steps for r in again] == [2, 2, 1]
