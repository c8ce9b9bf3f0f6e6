"""SFT rows from an environment's worked episodes (`algorithm=sft env=...`, and an online run's
warm start with `algorithm.warm_start.with_env`): a tool-calling format the model has never
seen is taught before GRPO has to find it by sampling.

A row is laid out as the collector lays out an episode (envs/episodes.py): the prompt as the
environment prepares it (its tools in the system message), then each policy turn's tokens and
its end-of-turn token, then the environment's reply as `observation_ids` renders it. The labels
are the policy's tokens only: the replies (a tool's results) are masked out of the loss, as
they are out of the policy loss in RL. An environment without a worked episode for an example
trains on its reference response after the prepared prompt, as plain SFT does.
"""

from __future__ import annotations

from posttrain.data.datamodule import prompt_token_ids, sft_batch
from posttrain.data.examples import Example
from posttrain.envs.base import Environment, Reply, observation_ids

IGNORED = -100  # the label of a token the loss skips


def worked_episode_row(env: Environment, example: Example, tokenizer) -> tuple[list[int], list[int]]:
    """(token ids, labels) of one SFT row of `example` with `env` (see the module docstring)."""
    prompt = prompt_token_ids(env.prepare(example), tokenizer)
    messages = env.worked_episode(example)
    if messages is None:
        messages = [{"role": "assistant", "content": example.response}]
    if not messages or messages[-1].get("role") != "assistant":
        raise ValueError(f"{type(env).__name__}.worked_episode must end with the policy's turn (role "
                         f"'assistant'), got {messages[-1:]!r}")
    ids, labels, replies = list(prompt), [IGNORED] * len(prompt), []
    for message in messages:
        if message["role"] != "assistant":
            replies.append(message)
            continue
        if replies:
            observed = observation_ids(Reply(messages=replies), tokenizer)
            ids += observed
            labels += [IGNORED] * len(observed)
            replies = []
        turn = tokenizer(message["content"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids += turn
        labels += turn
    return ids, labels


def worked_row_length(example: Example, tokenizer, env: Environment) -> int:
    """The tokens of `example`'s worked-episode row (the data module checks it fits the context)."""
    return len(worked_episode_row(env, example, tokenizer)[0])


def collate_worked_episodes(examples: list[Example], tokenizer, env: Environment) -> dict:
    """`collate_sft`'s batch (input_ids, attention_mask, labels), from worked episodes."""
    rows, labels = zip(*(worked_episode_row(env, example, tokenizer) for example in examples))
    return sft_batch(list(rows), list(labels), tokenizer.pad_token_id)
