"""Rollout producers: who runs the collect stage (collect.py) for the trainer.

A producer hands the trainer rollout batch `index` when asked (`next_batch`), and is told of
every policy update (`publish`: the new version's weights, and the curriculum's feedback on
the batch just trained on). `rollout.max_staleness=k` bounds how far it may run ahead: batch
`index` is sampled with a policy version of at least index - k (version = rollout batches
trained on), so a batch lags at most k updates when the trainer consumes it.

  InlineProducer   the trainer's own process, batch by batch: the synchronous pipeline
                   (max_staleness=0, the default)
  ProcessProducer  a torch.multiprocessing process beside the trainer with its own copy of the
                   policy; new weights reach it through shared memory after each update

Any object with these four methods can serve (`RolloutProducer`): a producer on other nodes
(Ray actors, a vLLM server) would implement `publish` as a weight broadcast and `next_batch`
as a queue read, and the trainer would not change. Only the two here are tested.

The trainer, not the producer, reduces over ranks: each rank has its own producer drawing its
own prompts; the ranks consume batch `index` at the same step and all-reduce what they must
agree on (OnlineRLModule.collect).
"""

from __future__ import annotations

import contextlib
import pickle
import queue
import time
import traceback
from typing import Protocol

import torch
import torch.multiprocessing as mp

from posttrain.algorithms.online.collect import CollectedBatch, Collector
from posttrain.errors import PosttrainError

# How often a waiting side looks whether the other is still alive, in seconds.
POLL_S = 1.0
# How long close() waits for the producer to stop before terminating it, in seconds.
STOP_TIMEOUT_S = 10.0


class RolloutProducer(Protocol):
    def start(self, index: int, version: int, policy, state: dict) -> None:
        """Begin with batch `index`, the policy at `version`, the collector state `state`."""

    def next_batch(self, index: int) -> CollectedBatch: ...

    def publish(self, version: int, policy, feedback: dict | None) -> None:
        """After an update: the policy's new weights are `version`; `feedback` holds
        `Curriculum.on_step_end`'s arguments for the batch trained on."""

    def close(self) -> None: ...


class InlineProducer:
    """The synchronous pipeline: the trainer collects each batch itself, with its own policy and
    curriculum, when it needs it."""

    def __init__(self, collector: Collector):
        self.collector = collector

    def start(self, index: int, version: int, policy, state: dict) -> None:
        self.collector.load_partial_state(state)

    def next_batch(self, index: int) -> CollectedBatch:
        self.collector.version = index  # every batch before this one has been trained on
        return self.collector.collect(index)

    def publish(self, version: int, policy, feedback: dict | None) -> None:
        pass  # it samples with the trainer's own policy, and the trainer's curriculum has had the feedback

    def close(self) -> None:
        pass


class ProcessProducer:
    """A producer process (torch.multiprocessing, spawned) running `collector`, whose sampler
    (sampler.py) holds a copy of the policy and an engine of its own; `threads` torch threads; `autocast_dtype`
    the trainer's mixed precision (None: none), so that it samples as the trainer would.

    `launch` spawns the process early (its imports take seconds), `start` hands it the collector
    and the weights. Weights: one shared-memory buffer per parameter. `publish` copies the
    policy into them under a lock and bumps the shared version; before each batch the producer
    copies the newest into its model under the same lock, so it never samples from half-written
    weights and the trainer never waits for a generation to end. Batches come back pickled by
    value."""

    def __init__(self, collector: Collector, max_staleness: int, threads: int,
                 autocast_dtype: torch.dtype | None = None):
        self.collector = collector
        self.max_staleness, self.threads, self.autocast_dtype = max_staleness, threads, autocast_dtype
        self.process = None
        self.staging: dict[str, torch.Tensor] = {}

    def launch(self) -> None:
        context = mp.get_context("spawn")
        self.lock, self.version = context.Lock(), context.Value("q", -1)
        self.inbox, self.outbox = context.Queue(), context.Queue()
        self.process = context.Process(target=produce, name="posttrain-rollout-producer", daemon=True,
                                       args=(self.lock, self.version, self.inbox, self.outbox))
        self.process.start()

    def start(self, index: int, version: int, policy, state: dict) -> None:
        if self.process is None:
            self.launch()
        collector = self.collector
        collector.load_partial_state(state)
        collector.rounds_agree = None  # a producer's rounds are its own: it takes no collective
        self.staging = {name: p.detach().to("cpu", copy=True).share_memory_()
                        for name, p in collector.sampler.model.named_parameters()}
        self.inbox.put(("start", (collector, self.staging, index, self.max_staleness, self.threads,
                                  self.autocast_dtype)))
        self.publish(version, policy, None, every_parameter=True)

    def next_batch(self, index: int) -> CollectedBatch:
        while True:
            try:
                kind, payload = self.outbox.get(timeout=POLL_S)
            except queue.Empty:
                if not self.process.is_alive():
                    raise RuntimeError(f"the rollout producer process died (exit code {self.process.exitcode}) "
                                       f"before rollout batch {index}") from None
                continue
            if kind == "error":
                self.close()
                raise payload
            batch = pickle.loads(payload)
            if batch.index != index:  # the batches come in order; anything else is a bug
                raise RuntimeError(f"the rollout producer sent batch {batch.index}, the trainer expects {index}")
            return batch

    def publish(self, version: int, policy, feedback: dict | None, every_parameter: bool = False) -> None:
        # only the parameters that train change (a frozen base, a LoRA policy's, does not)
        parameters = dict(policy.named_parameters())
        names = [n for n in self.staging if every_parameter or parameters[n].requires_grad]
        with self.lock:
            for name in names:
                self.staging[name].copy_(parameters[name].detach())
            self.version.value = version
        self.inbox.put(("update", (version, feedback)))

    def close(self) -> None:
        if self.process is None:
            return
        self.inbox.put(("stop", None))
        self.process.join(timeout=STOP_TIMEOUT_S)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join()
        self.process = None


def receive(inbox, timeout: float, parent):
    """The next message (kind, payload); ("stop", None) when the trainer's process is gone;
    None when nothing came within `timeout`."""
    try:
        return inbox.get(timeout=timeout) if timeout else inbox.get_nowait()
    except queue.Empty:
        if parent is not None and not parent.is_alive():
            return "stop", None
        return None


def produce(lock, shared_version, inbox, outbox) -> None:
    """The producer process: wait for the collector ("start"), then for batch index, index + 1,
    ...: take the messages (weights published, the curriculum's feedback) until the weights are
    recent enough, load the newest weights, collect, send. Exits on a stop message, or when the
    trainer's process is gone."""
    parent = mp.parent_process()
    try:
        message = None
        while message is None:
            message = receive(inbox, POLL_S, parent)
        if message[0] == "stop":
            return
        collector, staging, index, max_staleness, threads, autocast_dtype = message[1]
        torch.set_num_threads(threads)
        model = collector.sampler.model.to(collector.device)
        parameters = dict(model.named_parameters())
        autocast = (torch.autocast(collector.device.type, dtype=autocast_dtype) if autocast_dtype is not None
                    else contextlib.nullcontext())
        latest, loaded = -1, -1
        while True:
            while True:  # every waiting message, and more until the weights are recent enough
                behind = latest < index - max_staleness
                message = receive(inbox, POLL_S if behind else 0.0, parent)
                if message is None:
                    if behind:
                        continue
                    break
                kind, payload = message
                if kind == "stop":
                    return
                latest, feedback = payload
                if feedback is not None:
                    collector.curriculum.on_step_end(**feedback)
            if shared_version.value > loaded:
                with lock, torch.no_grad():
                    for name, buffer in staging.items():
                        parameters[name].copy_(buffer)
                    loaded = shared_version.value
                collector.sampler.weights_loaded()
            collector.version = loaded
            started = time.perf_counter()
            with autocast:
                batch = collector.collect(index)
            batch.metrics["perf/produce_s"] = time.perf_counter() - started
            batch.experience = batch.experience.to("cpu")
            outbox.put(("batch", pickle.dumps(batch)))
            index += 1
    except BaseException as err:  # noqa: BLE001 - every failure goes to the trainer, which raises it
        if not isinstance(err, PosttrainError):  # a bug, not bad input: the producer's traceback with it
            err = RuntimeError(f"in the rollout producer process:\n{traceback.format_exc()}")
        outbox.put(("error", err))
    finally:
        outbox.cancel_join_thread()  # exit without waiting for the trainer to read what is left
