"""The thinking budget (rollout/thinking.py) against a scripted model: hand-checked token
sequences for a model that closes its reasoning itself, one that is cut by the budget, one
that ends first, a marker of several tokens, and a budget that leaves no room to answer."""

import torch

from posttrain.rollout.base import RolloutBatch, SamplingParams
from posttrain.rollout.thinking import generate_with_thinking_budget, rest_of_marker

PAD, EOS, THINK, ANSWER, END = 0, 1, 5, 9, 7  # END: a one-token end-of-thinking marker ("</think>")
END2 = [7, 8]                                  # a marker of two tokens


class ScriptedModel:
    """A `generate` whose model writes, after a prompt [n]: n reasoning tokens THINK, the
    marker, then ANSWER `answer_len` times and EOS. Once the marker is in its context (written
    by it or appended) it answers. Greedy and deterministic; each token's log-prob is -0.5."""

    def __init__(self, marker: list[int], answer_len: int = 1):
        self.marker, self.answer_len = marker, answer_len
        self.calls: list[tuple[list[list[int]], int]] = []  # (prompts without padding, max_new_tokens)

    def next_token(self, context: list[int]) -> int:
        n, response = context[0], context[1:]
        for k in range(len(response) - len(self.marker) + 1):
            if response[k:k + len(self.marker)] == self.marker:  # the reasoning is over: answer
                answered = len(response) - k - len(self.marker)
                return ANSWER if answered < self.answer_len else EOS
        written = [t for t in response if t not in self.marker]
        if len(written) < n:
            return THINK
        missing = rest_of_marker(response, self.marker)
        return missing[0]

    def __call__(self, prompt_ids, prompt_mask, params, generator=None):
        prompts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]
        self.calls.append((prompts, params.max_new_tokens))
        rows, truncated = [], []
        for prompt in prompts:
            row = []
            while len(row) < params.max_new_tokens and (not row or row[-1] != EOS):
                row.append(self.next_token(prompt + row))
            rows.append(row)
            truncated.append(row[-1] != EOS)
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), PAD)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1
        return RolloutBatch(prompt_ids, prompt_mask, ids, mask, -0.5 * mask.float(), torch.tensor(truncated),
                            repeated=torch.zeros(len(rows), dtype=torch.bool))


def prompts(*lengths: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded one-token prompts [n] (a pad column in front, as a batch of prompts has)."""
    ids = torch.tensor([[PAD, n] for n in lengths])
    mask = torch.tensor([[0, 1]] * len(lengths))
    return ids, mask


def run(model, lengths, budget, max_new_tokens, marker):
    ids, mask = prompts(*lengths)
    out = generate_with_thinking_budget(model, ids, mask, SamplingParams(max_new_tokens=max_new_tokens, greedy=True,
                                                                         temperature=0.0), budget, marker, PAD)
    responses = [row[m.bool()].tolist() for row, m in zip(out.batch.response_ids, out.batch.response_mask)]
    return responses, out.forced.tolist(), out.batch.truncated.tolist(), out


def test_the_budget_cuts_the_reasoning_and_the_model_answers_after_the_forced_marker():
    model = ScriptedModel([END])
    # prompt [4]: the model would think 4 tokens; prompt [1]: 1 token, then the marker itself;
    # prompt [0]: no reasoning at all, it ends (EOS) within the budget
    responses, forced, truncated, out = run(model, [4, 1, 0], budget=3, max_new_tokens=8, marker=[END])
    assert responses == [[THINK, THINK, THINK, END, ANSWER, EOS],  # cut after 3, END appended, then the answer
                         [THINK, END, ANSWER, EOS],                # wrote END itself within 3 tokens: goes on
                         [END, ANSWER, EOS]]                       # ended (EOS) in the first call: as it is
    assert forced == [True, False, False] and truncated == [False, False, False]
    # the first call is the budget; the rows that go on continue from prompt + their tokens, each
    # with the rest of the 8 tokens (8 - 4 for the forced row, 8 - 3 for the one that closed itself)
    assert model.calls[0] == ([[4], [1], [0]], 3)
    assert model.calls[1] == ([[4, THINK, THINK, THINK, END], [1, THINK, END, ANSWER]], 5)
    # the appended marker was not sampled: log-prob 0; the sampled tokens keep theirs
    assert out.batch.logprobs[0].tolist() == [-0.5, -0.5, -0.5, 0.0, -0.5, -0.5]


def test_a_row_that_closed_its_reasoning_at_the_budget_goes_on_unforced():
    responses, forced, truncated, _ = run(ScriptedModel([END]), [3], budget=4, max_new_tokens=8, marker=[END])
    assert responses == [[THINK, THINK, THINK, END, ANSWER, EOS]] and forced == [False] and truncated == [False]


def test_a_budget_of_zero_forces_the_marker_first_and_a_large_one_changes_nothing():
    model = ScriptedModel([END])
    responses, forced, _, _ = run(model, [3], budget=0, max_new_tokens=8, marker=[END])
    assert responses == [[END, ANSWER, EOS]] and forced == [True]
    assert model.calls == [([[3, END]], 7)]  # no first call: the marker is the whole reasoning
    model = ScriptedModel([END])
    responses, forced, truncated, _ = run(model, [20], budget=8, max_new_tokens=8, marker=[END])
    assert responses == [[THINK] * 8] and forced == [False] and truncated == [True]
    assert model.calls == [([[20]], 8)]  # budget >= max_new_tokens: one plain call


def test_a_marker_of_several_tokens_cut_by_the_budget_is_completed_not_repeated():
    model = ScriptedModel(END2)
    # prompt [2]: THINK THINK 7 | 8 ...: the budget of 3 cuts the marker after its first token
    responses, forced, _, _ = run(model, [2, 5], budget=3, max_new_tokens=10, marker=END2)
    assert responses == [[THINK, THINK, 7, 8, ANSWER, EOS],
                         [THINK, THINK, THINK, 7, 8, ANSWER, EOS]]
    assert forced == [True, True]


def test_each_row_answers_within_its_own_rest_of_the_budget():
    model = ScriptedModel(END2, answer_len=5)  # a long answer: every row runs out
    # row [1]: THINK 7 8 within the budget of 3 (closed itself, 7 tokens left);
    # row [9]: cut, 7 8 appended (5 tokens left): the second call samples up to 7 for both
    responses, forced, truncated, _ = run(model, [1, 9], budget=3, max_new_tokens=10, marker=END2)
    assert responses == [[THINK, 7, 8] + [ANSWER] * 5 + [EOS],
                         [THINK, THINK, THINK, 7, 8] + [ANSWER] * 5]
    assert forced == [False, True] and truncated == [False, True]
    assert model.calls[1][1] == 7


def test_no_room_left_for_an_answer_ends_the_response_at_the_marker():
    responses, forced, truncated, _ = run(ScriptedModel([END]), [9], budget=3, max_new_tokens=4, marker=[END])
    assert responses == [[THINK, THINK, THINK, END]] and forced == [True] and truncated == [True]
