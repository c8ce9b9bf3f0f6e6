"""Guess the number (data/guess_number.py): the environment that answers each guess."""

from __future__ import annotations

from posttrain.data.guess_number import feedback, parse_guess
from posttrain.envs.base import Environment, Reply, Turn


class GuessNumberEpisode:
    def __init__(self, secret: int, max_turns: int, turn_penalty: float):
        self.secret, self.max_turns, self.turn_penalty = secret, max_turns, turn_penalty

    def step(self, turn: Turn) -> Reply:
        guess = parse_guess(turn.text)
        if guess == self.secret:
            return Reply(reward=1.0, done=True, correct=True)
        last = turn.index + 1 >= self.max_turns
        metrics = {"invalid_guesses": float(guess is None)}
        if last:
            return Reply(reward=0.0, done=True, correct=False, metrics=metrics)
        # an unreadable guess is answered like a guess of 0: the secret is higher
        return Reply(reward=-self.turn_penalty, text=feedback(guess or 0, self.secret), metrics=metrics)


class GuessNumber(Environment):
    """Reward 1 at the turn that names the secret (0 if none does, `turn_penalty` off each turn
    that misses); the episode ends there or after `max_turns`."""

    name = "guess_number"
    metric_names = ("invalid_guesses",)

    def __init__(self, max_turns: int = 3, turn_penalty: float = 0.0):
        super().__init__(max_turns)
        self.turn_penalty = float(turn_penalty)

    def start(self, example) -> GuessNumberEpisode:
        return GuessNumberEpisode(int(example.answer), self.max_turns, self.turn_penalty)
