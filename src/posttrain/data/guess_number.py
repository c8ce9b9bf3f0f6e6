"""Guess the number: a multi-turn task for the embedded model, where credit must cross turns.

A secret integer in [1, max_number] is hidden; the policy guesses one number per turn and the
environment (envs/guess_number.py) answers " higher" or " lower" until the guess is right or
`max_turns` are spent. Every prompt reads the same: what tells the secrets apart is the
feedback, so a policy does well only by choosing guesses that make the feedback informative
(halving the range: 7 of 8 secrets in 3 turns for max_number=8) and then using it. Reward comes
at the end, so a good first guess is credited only through the later turns it makes possible.

The reference response (the SFT warm start's target) is a transcript of a player who guesses
uniformly among the numbers the feedback so far allows, written as the episode's tokens are:
each guess closed by the end-of-turn token, each reply after it, as the environment writes it.
"""

from __future__ import annotations

import random

from posttrain.data.examples import Example, PromptLimits
from posttrain.errors import ConfigError

SPLITS = ("train", "validation", "test")
PROMPT = "guess:"
HIGHER, LOWER = " higher\n", " lower\n"   # the environment's replies, appended after the turn's end-of-turn token
EOS_TEXT = "<eos>"                       # the embedded tokenizer's end-of-turn token, as text in a transcript


def feedback(guess: int, secret: int) -> str | None:
    """The reply to a guess: HIGHER (the secret is larger), LOWER, or None when it is right."""
    if guess == secret:
        return None
    return HIGHER if secret > guess else LOWER


def parse_guess(text: str) -> int | None:
    """A turn's guess: its text as an integer (None when it is not one)."""
    text = text.strip()
    return int(text) if text.isdigit() else None


class GuessNumberSource:
    """Endless seeded secrets per split; each split draws from its own stream."""

    def __init__(self, max_number: int = 8, max_turns: int = 3, seed: int = 0):
        for key, value, low in (("max_number", max_number, 2), ("max_turns", max_turns, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"data.{key}={value!r} must be an integer >= {low}")
        self.max_number, self.max_turns, self.seed = max_number, max_turns, seed
        digits = "".join(sorted(set("0123456789")))
        self.alphabet = "".join(sorted(set(PROMPT + HIGHER + LOWER + digits)))
        self.prompt_limits = PromptLimits()
        self.step_rule = None

    def size(self, split: str) -> int | None:
        return None

    def origin(self, split: str, index: int) -> str | None:
        return None  # generated: no file to point at

    def secret(self, split: str, index: int) -> int:
        if split not in SPLITS:
            raise ConfigError(f"guess_number has splits {list(SPLITS)}, not {split!r}")
        return random.Random(f"guess_number/{self.seed}/{split}/{index}").randint(1, self.max_number)

    def example(self, split: str, index: int) -> Example:
        secret = self.secret(split, index)
        rng = random.Random(f"guess_number/reference/{self.seed}/{split}/{index}")
        return Example(PROMPT, self.reference_transcript(secret, rng), str(secret))

    def reference_transcript(self, secret: int, rng: random.Random) -> str:
        """A consistent random player's episode: each guess uniform over what the feedback allows."""
        low, high, parts = 1, self.max_number, []
        for turn in range(self.max_turns):
            guess = rng.randint(low, high)
            reply = feedback(guess, secret)
            last = reply is None or turn == self.max_turns - 1
            parts.append(str(guess) if last else f"{guess}{EOS_TEXT}{reply}")
            if reply is None:
                break
            low, high = (guess + 1, high) if reply == HIGHER else (low, guess - 1)
        return "".join(parts)  # the SFT collate closes the last turn with the end-of-turn token

    def is_correct(self, example: Example, response: str) -> bool:
        """Without the environment (plain SFT evaluation): the response's last guess is the secret."""
        guesses = [parse_guess(part.split(EOS_TEXT)[0]) for part in response.replace(HIGHER, "\0").replace(
            LOWER, "\0").split("\0")]
        return bool(guesses) and guesses[-1] == int(example.answer)

    def has_style(self, response: str) -> bool:
        return parse_guess(response) is not None


def build_guess_number_source(data_cfg) -> GuessNumberSource:
    return GuessNumberSource(data_cfg.max_number, data_cfg.max_turns, data_cfg.seed)
