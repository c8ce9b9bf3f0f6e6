"""A mixture of task sources (`data=mixture`): each training example drawn from one of several
sources by weight, each keeping its source's name, each judged by its own source.

    data:
      source: mixture
      mixture:
        sums:  {weight: 3, data: {source: arithmetic, max_digits: 2}}
        mine:  {weight: 1, data: {source: jsonl, files: {train: mine.jsonl, validation: held.jsonl}},
                reward: {components: {accuracy: {weight: 1.0}, format: {weight: 0.2}}}}

A source's `data` holds the keys of conf/data/<kind>.yaml, over that file's defaults (its seed
defaults to the mixture's `data.seed`); any kind of `data.source` but `mixture` mixes, so a
kind registered in data/sources.py (a verifiers environment, data/verifiers_source.py) mixes as
soon as it is registered there. `reward` (optional) replaces the run's reward for that source's
samples (rewards/mixture.py routes them).

**Training stream.** Stream position p lies in block p // BLOCK; each block of BLOCK draws holds
each source's share of the total weight (largest remainder), in an order shuffled by (seed,
block). A source's k-th draw is its own stream's k-th example (its seeded order, as the source
alone would stream it), and k is counted inside the block, so example p is a pure function of
(seed, p): a resumed run starts at its saved position and continues every source's stream
without losing or repeating an example.

**Held-out splits** (validation, test): the sources in turn, a round of one example each (a
source whose split is used up drops out of the rounds): the first N held-out examples are an
even split, N / (number of sources) each, whatever the weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from posttrain.conf import CONFIG_DIR
from posttrain.data.datamodule import ExampleCursor
from posttrain.data.examples import Example, PromptLimits
from posttrain.errors import ConfigError, DataError

MIXTURE = "mixture"
# The keys of one source of data.mixture.
ENTRY_KEYS = ("weight", "data", "reward")
# Draws per block of the training stream: each source's share of a block is its share of the
# total weight, rounded, so a source needs at least 1 / BLOCK of the total weight.
BLOCK = 1000
HELDOUT_SPLITS = ("validation", "test")


def source_key(name: str, key: str = "") -> str:
    """How a message names a key of source `name`: data.mixture.<name>.<key>."""
    return f"data.mixture.{name}" + (f".{key}" if key else "")


def kind_defaults(kind: str) -> DictConfig:
    """The keys and defaults of conf/data/<kind>.yaml (without its interpolations' run values)."""
    return OmegaConf.load(Path(CONFIG_DIR) / "data" / f"{kind}.yaml")


def mixable_kinds() -> list[str]:
    """The kinds a mixture may hold: every conf/data file's source but the mixture itself."""
    return sorted(p.stem for p in (Path(CONFIG_DIR) / "data").glob("*.yaml") if p.stem != MIXTURE)


def source_data_config(name: str, data: Any, seed: int) -> DictConfig:
    """data.mixture.<name>.data over the defaults of its kind's conf/data file: the `data` node
    that source would have alone. Its `seed` defaults to the mixture's (the file's `${seed}`
    reads the run's seed, which is the mixture's by default too)."""
    key = source_key(name, "data")
    if not isinstance(data, Mapping):
        raise ConfigError(f"{key} must be a data config such as {{source: arithmetic}}, got {data!r}")
    kind = data.get("source")
    kinds = mixable_kinds()
    if kind == MIXTURE:
        raise ConfigError(f"{key}.source=mixture: a mixture's sources cannot be mixtures; list their sources here")
    if kind not in kinds:
        raise ConfigError(f"{key}.source={kind!r} is not a source kind; expected one of {kinds}")
    defaults = kind_defaults(kind)
    unknown = sorted(set(data) - set(defaults))
    if unknown:
        raise ConfigError(f"{key}: unknown key(s) {unknown} for data.source={kind}; valid keys: "
                          f"{', '.join(defaults)}")
    if "seed" in defaults:
        defaults.seed = seed
    return OmegaConf.merge(defaults, OmegaConf.create(dict(data)))


def mixture_weights(mixture: Mapping) -> dict[str, float]:
    """Each source's weight, checked: a positive number, with a share of at least 1 / BLOCK."""
    if not isinstance(mixture, Mapping) or not mixture:
        raise ConfigError(f"data.mixture must map source names to {{weight, data, reward}}, got {mixture!r}")
    weights = {}
    for name, entry in mixture.items():
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{source_key(name)} must be a mapping with keys {list(ENTRY_KEYS)}, got {entry!r}")
        unknown = sorted(set(entry) - set(ENTRY_KEYS))
        if unknown:
            raise ConfigError(f"{source_key(name)}: unknown key(s) {unknown}; valid keys: {', '.join(ENTRY_KEYS)}")
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < float("inf"):
            raise ConfigError(f"{source_key(name, 'weight')}={weight!r} must be a positive number (the source's "
                              f"share of the training draws is its weight over the total)")
        weights[str(name)] = float(weight)
    total = sum(weights.values())
    for name, weight in weights.items():
        if weight / total < 1 / BLOCK:
            raise ConfigError(f"{source_key(name, 'weight')}={weight} is {weight / total:.2g} of the total weight "
                              f"{total}: a source needs at least 1/{BLOCK} of it (a block of {BLOCK} draws holds "
                              f"each source at least once)")
    return weights


def block_counts(weights: list[float], block: int = BLOCK) -> list[int]:
    """Each source's draws in a block of `block`: its share of the weight, rounded by largest
    remainder (ties to the earlier source), so the counts sum to `block`."""
    total = sum(weights)
    exact = [block * w / total for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda k: (-(exact[k] - counts[k]), k))
    for k in by_remainder[: block - sum(counts)]:
        counts[k] += 1
    return counts


class MixtureSource:
    """Several task sources as one (module docstring). `sources` and `weights` are keyed by
    name, in the config's order; `seeds` is each source's own stream seed; `rewards` each
    source's reward override (None: the run's reward)."""

    def __init__(self, sources: dict[str, Any], weights: dict[str, float], seeds: dict[str, int], seed: int,
                 rewards: dict[str, Mapping | None] | None = None):
        self.source_names = tuple(sources)  # the metrics' names (rollout/<name>/..., eval/<name>/...)
        self.sources = dict(sources)
        self.weights = {name: float(weights[name]) for name in self.source_names}
        self.seeds = dict(seeds)
        self.seed = seed
        self.rewards = {name: (rewards or {}).get(name) for name in self.source_names}
        self.counts = block_counts([self.weights[name] for name in self.source_names])
        self.prompt_limits = PromptLimits()  # the mixture's own (data.max_response_tokens ...): build_source sets them
        self.step_rule = None
        # block -> each draw's (source, draws of that source before it in the block)
        self._blocks: dict[int, tuple[list[int], list[int]]] = {}
        self._heldout: dict[str, list[tuple[int, int]]] = {}  # split -> (source, its index) of each held-out index

    # -- the training stream

    def block(self, block: int) -> tuple[list[int], list[int]]:
        """Each draw of `block`: which source (its index in source_names), and how many of that
        source's draws come before it in the block."""
        if block not in self._blocks:
            if len(self._blocks) > 4:  # the stream reads its blocks in order: keep the last few
                self._blocks.pop(min(self._blocks))
            labels = torch.repeat_interleave(torch.arange(len(self.counts)), torch.tensor(self.counts))
            order = torch.randperm(BLOCK, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + block))
            which = labels[order].tolist()
            seen = [0] * len(self.counts)
            ranks = []
            for k in which:
                ranks.append(seen[k])
                seen[k] += 1
            self._blocks[block] = (which, ranks)
        return self._blocks[block]

    def train_place(self, position: int) -> tuple[int, int]:
        """(source, position in that source's own stream) of mixture stream position `position`."""
        block, offset = divmod(position, BLOCK)
        which, ranks = self.block(block)
        k = which[offset]
        return k, block * self.counts[k] + ranks[offset]

    # -- held-out splits

    def heldout_place(self, split: str, index: int) -> tuple[int, int]:
        """(source, index in that source's `split`) of held-out example `index`: the sources in turn."""
        order = self._heldout.setdefault(split, [])
        sizes = [self._split_size(name, split) for name in self.source_names]
        while len(order) <= index:
            round_ = len(order) and order[-1][1] + 1  # rounds are whole: the next starts after the last one's
            members = [(k, round_) for k, size in enumerate(sizes) if size is None or round_ < size]
            if not members:
                raise IndexError(f"held-out index {index} of data=mixture's {split} split, which holds "
                                 f"{len(order)} examples")
            order.extend(members)
        return order[index]

    def _split_size(self, name: str, split: str) -> int | None:
        try:
            return self.sources[name].size(split)
        except ConfigError as err:  # the source's own key names its own node: say which source it is
            raise ConfigError(f"{source_key(name, 'data')}: {err}") from None

    # -- the source protocol

    def size(self, split: str) -> int | None:
        """None (endless) for training and for a held-out split any source has endless; else the
        sum of the sources' sizes."""
        if split == "train":
            return None
        sizes = [self._split_size(name, split) for name in self.source_names]
        return None if None in sizes else sum(sizes)

    def place(self, split: str, index: int) -> tuple[int, int]:
        return self.train_place(index) if split == "train" else self.heldout_place(split, index)

    def example(self, split: str, index: int) -> Example:
        k, local = self.place(split, index)
        name = self.source_names[k]
        source = self.sources[name]
        if split == "train":  # the source's own seeded order, as it would stream alone
            local = ExampleCursor(source, "train", self.seeds[name]).index(local)
        example = source.example(split, local)
        return dataclasses.replace(example, source=name)  # a copy: a finite source's list stays as it is

    def origin(self, split: str, index: int) -> str | None:
        k, local = self.place(split, index)
        name = self.source_names[k]
        source = self.sources[name]
        if split == "train":
            local = ExampleCursor(source, "train", self.seeds[name]).index(local)
        where = source.origin(split, local) if hasattr(source, "origin") else None
        return f"{where or f'{split} example {local}'} of {source_key(name)}"

    @property
    def alphabet(self) -> str | tuple[str, ...]:
        """Every symbol of the sources (the embedded model's vocabulary): characters sorted, then
        whole-word symbols (the r1 tags) in the sources' order."""
        symbols = [s for name in self.source_names for s in self.sources[name].alphabet]
        chars = sorted({s for s in symbols if len(s) == 1})
        words = list(dict.fromkeys(s for s in symbols if len(s) > 1))
        return (*chars, *words) if words else "".join(chars)

    def source_of(self, example: Example):
        """The source that judges `example` (its `source` names it)."""
        if example.source not in self.sources:
            raise DataError(f"the example with prompt {example.prompt[:60]!r} names source {example.source!r}, which "
                            f"is not one of data.mixture's {list(self.source_names)}")
        return self.sources[example.source]

    def is_correct(self, example: Example, response: str) -> bool:
        return self.source_of(example).is_correct(example, response)

    def step_correctness(self, example: Example, response: str) -> list[bool]:
        return self.source_of(example).step_correctness(example, response)

    def step_labels(self, example: Example, steps: list[str]) -> list[bool]:
        return self.source_of(example).step_labels(example, steps)

    def _needs_the_example(self, what: str):
        raise DataError(f"data=mixture reads a response's {what} with the source of its example: call "
                        f"source.source_of(example).{what}(response)")

    def final_answer(self, response: str) -> str | None:
        self._needs_the_example("final_answer")

    def has_style(self, response: str) -> bool:
        self._needs_the_example("has_style")

    def format_score(self, response: str) -> float:
        self._needs_the_example("format_score")


def build_mixture_source(data_cfg, build_source: Callable) -> MixtureSource:
    """The source of a `data=mixture` node; `build_source` (data/sources.py) builds each of its
    sources from its `data` node."""
    mixture = OmegaConf.to_container(data_cfg.mixture, resolve=True) if isinstance(
        data_cfg.mixture, DictConfig) else data_cfg.mixture
    weights = mixture_weights(mixture)
    sources, seeds, rewards = {}, {}, {}
    for name, entry in mixture.items():
        node = source_data_config(name, entry.get("data"), data_cfg.seed)
        try:
            sources[name] = build_source(node)
        except ConfigError as err:
            raise ConfigError(f"{source_key(name, 'data')}: {err}") from None
        seeds[name] = node.get("seed", data_cfg.seed)
        rewards[name] = entry.get("reward")
    return MixtureSource(sources, weights, seeds, data_cfg.seed, rewards)
