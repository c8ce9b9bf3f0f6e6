"""The `posttrain-eval` entry point: score a trained policy without training (conf/evaluate.yaml).

    posttrain-eval checkpoint=outputs/sft/runs/<time>                    # a run: its hf_model/ (else last.ckpt)
    posttrain-eval checkpoint=<run dir>/checkpoints/step000300.ckpt pass_k=[1,4,8] num_samples=8
    posttrain-eval checkpoint=<Hugging Face model dir> eval.split=test eval.num_prompts=512
    posttrain-eval checkpoint=<run dir> best_of_n.n=[1,4,16] best_of_n.prm=oracle
    posttrain-eval checkpoint=<run dir> thinking_budget=[4,8,16]         # accuracy against a thinking budget
    posttrain-eval checkpoint=<run dir> 'eval.suites={words: {data: word_problems, samples: 4}}'   # suites

Reports held-out greedy accuracy, mean response length and calibration (`eval/ece`,
`eval/confidence`, `eval/reliability/*`) through training's own validation code (so a
run's final model reproduces the `eval/*` numbers of its summary.json), unbiased pass@k
from `num_samples` sampled responses per prompt, and, with
`best_of_n.n`, best-of-n accuracy by a PRM, an ORM, majority vote and the verifier
(best_of_n.py), and, with `thinking_budget`, greedy accuracy when the reasoning is cut at
each budget and its end forced (rollout/thinking.py). The evaluation suites (`eval.suites`,
a run's own unless the command line sets them; algorithms/eval_suites.py) and the accuracy
per `Example.source` (`eval/<source>/accuracy`) come from the same validation. Writes eval.json in
outputs/eval/runs/<time>/.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from posttrain.core.options import is_int
from posttrain.errors import ConfigError, DataError
from posttrain.run.boundary import hydra_command, log, silence_expected_warnings
from posttrain.run.precision import cpu_precision
from posttrain.run.run_dir import find_weights, is_adapter_dir, load_from_adapter

# What a run's config.yaml decides, so that the tokenizer, task, prompts and numerics are training's.
RUN_SETTINGS = ("model", "data", "eval", "rollout", "env", "trainer.accelerator", "trainer.precision")


def command_line_keys() -> list[str]:
    """The keys (or config groups) this job's command-line overrides set."""
    # start-up: Hydra's internals load only inside a job
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if not HydraConfig.initialized():
        return []
    overrides = OverridesParser.create().parse_overrides(list(HydraConfig.get().overrides.task))
    return [override.key_or_group for override in overrides]


def take_run_settings(cfg: DictConfig, run_config: Path) -> None:
    """Replace the composed RUN_SETTINGS by the run's own, then put back what the command
    line set (the composed config holds those values: an override wins over the run)."""
    run_cfg = OmegaConf.load(run_config)
    composed = cfg.copy()
    sections = {key.split(".")[0] for key in RUN_SETTINGS}
    with open_dict(cfg):
        for key in RUN_SETTINGS:
            if OmegaConf.select(run_cfg, key) is not None:
                OmegaConf.update(cfg, key, OmegaConf.select(run_cfg, key), merge=False)
        for key in command_line_keys():
            if key.split(".")[0] in sections:
                OmegaConf.update(cfg, key, OmegaConf.select(composed, key), merge=False)


def check_sampling(cfg: DictConfig) -> None:
    """pass@k needs k <= num_samples sampled responses per prompt, at a temperature > 0."""
    if not cfg.pass_k:
        return
    for k in cfg.pass_k:
        if not isinstance(k, int) or k < 1:
            raise ConfigError(f"pass_k={list(cfg.pass_k)}: every k must be an integer >= 1 (got {k!r})")
        if k > cfg.num_samples:
            raise ConfigError(f"pass_k={list(cfg.pass_k)} asks for pass@{k}, but num_samples={cfg.num_samples}: "
                              f"pass@k is estimated from num_samples sampled responses per prompt, so it needs "
                              f"num_samples >= k. Raise num_samples or drop k from pass_k")
    if not cfg.temperature > 0:
        raise ConfigError(f"temperature={cfg.temperature}: pass@k samples, so it needs a temperature > 0 "
                          f"(the greedy accuracy is reported anyway; pass_k=[] skips sampling)")


def check_thinking_budgets(cfg: DictConfig) -> list[int]:
    """`thinking_budget`: null, or one or several numbers of reasoning tokens (each >= 0)."""
    value = cfg.get("thinking_budget")
    if value is None:
        return []
    budgets = [value] if isinstance(value, int) else list(value) if OmegaConf.is_list(value) else None
    if not budgets or not all(is_int(b) and b >= 0 for b in budgets):
        raise ConfigError(f"thinking_budget={value!r}: expected null, or a number of reasoning tokens >= 0 or a "
                          f"list of them, e.g. thinking_budget=[8,16,32]")
    return budgets


def end_of_thinking_ids(cfg: DictConfig, source, tokenizer) -> tuple[str, list[int]]:
    """The marker that ends a response's reasoning, as text and as token ids: `end_of_thinking`,
    else the task's own (the r1 template's </think>; the arithmetic task's ">" after its verbose
    column steps)."""
    template = getattr(source, "template", None)
    marker = (cfg.get("end_of_thinking") or getattr(source, "end_of_thinking", None)
              or getattr(template, "end_of_thinking", None))
    if not marker:
        raise ConfigError(f"thinking_budget={cfg.thinking_budget}: this task has no marker that ends the reasoning "
                          f"(data.template=r1 has </think>, data.style=verbose of the arithmetic task has '>'); "
                          f"name it with end_of_thinking=..., e.g. end_of_thinking='</think>' for Qwen3")
    ids = tokenizer(marker, add_special_tokens=False)["input_ids"]
    if not ids or tokenizer.unk_token_id in ids:
        raise ConfigError(f"end_of_thinking={marker!r} is not in the tokenizer's vocabulary (it encodes as {ids})")
    return marker, ids


def thinking_budget_scores(module, batch: dict, budget: int, end_ids: list[int]):
    """[rows, 3]: (correct, response length, forced) of a greedy response to each prompt of
    `batch` with at most `budget` reasoning tokens (rollout.thinking)."""
    import torch  # start-up: torch loads only once the arguments are checked

    from posttrain.rollout import SamplingParams
    from posttrain.rollout.base import decode_responses
    from posttrain.rollout.thinking import generate_with_thinking_budget

    params = SamplingParams(max_new_tokens=module.eval_max_new_tokens, greedy=True, temperature=0.0)
    out = generate_with_thinking_budget(module.generate, batch["prompt_ids"], batch["prompt_mask"], params, budget,
                                        end_ids, module.tokenizer.pad_token_id)
    texts = decode_responses(module.tokenizer, out.batch.response_ids, out.batch.response_mask)
    correct = [float(module.source.is_correct(e, t)) for e, t in zip(batch["examples"], texts)]
    return torch.stack([torch.tensor(correct), out.batch.response_lengths().float().cpu(), out.forced.float().cpu()],
                       dim=1)


def build_eval_module(policy, tokenizer, source, cfg: DictConfig):
    """Training's held-out evaluation, inherited as it is (greedy accuracy and response length
    through `validation_step`), plus `predict_step`: `num_samples` responses per prompt sampled
    at `temperature`, counted correct per prompt by `count_correct_samples`, as training's
    held-out pass@k does; or, once `judges` is set, judged for best-of-N (`sample_and_judge`).
    (The class is made here so that argument errors come before torch and Lightning load.)"""
    # start-up: torch and Lightning load only once the arguments are checked
    import torch

    from posttrain.algorithms.base import PosttrainModule, count_correct_samples
    from posttrain.envs.build import build_env, turn_tokens
    from posttrain.eval.best_of_n import sample_and_judge
    from posttrain.rollout import SamplingParams

    class EvalModule(PosttrainModule):
        def __init__(self, sampling: SamplingParams, num_samples: int, seed: int):
            super().__init__(policy, tokenizer, source, optim=None, rollout=cfg.rollout,
                             eval_max_new_tokens=cfg.eval.max_new_tokens)
            self.sampling, self.num_samples, self.seed = sampling, num_samples, seed
            # the run's environment: each prompt is then an episode, greedy and sampled alike
            self.env, self.turn_tokens = build_env(cfg.get("env"), source), turn_tokens(cfg.get("env"))
            self.judges = None  # best_of_n.Judges: predict judges the samples instead of counting correct ones
            # (budget, end-of-thinking token ids): predict scores greedy responses under a thinking budget
            self.thinking = None

        def on_predict_start(self) -> None:
            self.generator = torch.Generator(device=self.device).manual_seed(self.seed)  # the same draws every time

        def predict_step(self, batch, batch_idx):
            if self.thinking is not None:
                return thinking_budget_scores(self, batch, *self.thinking)
            # the loader's batches are batch_size // num_samples prompts: one generate call each
            if self.judges is not None:
                return sample_and_judge(self, batch, self.sampling, self.num_samples, self.generator, self.judges)
            return count_correct_samples(self, batch, self.sampling, self.num_samples, self.generator,
                                         rows_per_call=cfg.eval.batch_size)

    sampling = SamplingParams(max_new_tokens=cfg.eval.max_new_tokens, temperature=cfg.temperature,
                              top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k)
    return EvalModule(sampling, num_samples=cfg.num_samples, seed=cfg.seed)


def evaluate(cfg: DictConfig) -> dict:
    """Score the policy at `cfg.checkpoint`; returns the results also written to eval.json."""
    # what to load, and from which settings, before anything heavy loads: mistakes fail fast
    check_sampling(cfg)  # the command line's alone, whatever the run says
    thinking_budgets = check_thinking_budgets(cfg)
    from posttrain.eval.best_of_n import check_best_of_n  # start-up: it loads torch; the cheap check comes first

    best_of_n_sizes = check_best_of_n(cfg)
    weights = find_weights(cfg.checkpoint)
    if weights.run_dir is not None:
        take_run_settings(cfg, weights.run_dir / "config.yaml")
    with open_dict(cfg):
        if weights.is_hf_dir and is_adapter_dir(weights.path):
            load_from_adapter(cfg.model, weights.path)
        elif weights.is_hf_dir:  # the export carries its own tokenizer and architecture
            cfg.model.name_or_path, cfg.model.init_from = str(weights.path), None
            if cfg.model.get("lora") is not None:
                cfg.model.lora.r = None  # a merged export: no adapter on top
        else:  # the run's architecture (and tokenizer), the checkpoint's policy weights
            cfg.model.init_from = str(weights.path)
    OmegaConf.resolve(cfg)
    output_dir = Path(cfg.paths.output_dir)

    # start-up: what the evaluation itself needs loads once the weights and settings are found
    import logging
    import time
    import warnings

    import lightning as L
    import torch
    from torch.utils.data import DataLoader
    from transformers.utils import logging as transformers_logging

    from posttrain.core import pass_at_k
    from posttrain.data.datamodule import PosttrainDataModule, collate_prompts
    from posttrain.data.sources import build_source
    from posttrain.eval.best_of_n import Judged, best_of_n_accuracies, build_judges, check_source_for_prm
    from posttrain.files import write_json_atomic
    from posttrain.models.loading import load_tokenizer_and_model

    silence_expected_warnings()
    # one in-process evaluation: Lightning's hint about loader workers is noise here
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    # the table is the output: no Lightning banners (accelerator, tips), no weight-loading bars
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    transformers_logging.disable_progress_bar()
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)

    source = build_source(cfg.data)
    if best_of_n_sizes:
        check_source_for_prm(cfg.best_of_n, source, cfg.data.source)
    tokenizer, policy = load_tokenizer_and_model(cfg.model, source.alphabet)
    module = build_eval_module(policy, tokenizer, source, cfg)
    module.configure_eval(cfg.eval, seed=cfg.seed)  # the suites: built and checked before any generation
    if thinking_budgets:  # before any generation: a task without a marker fails fast
        marker, end_ids = end_of_thinking_ids(cfg, source, tokenizer)
    # the held-out prompts exactly as training builds them (no training stream: batch_size unused)
    datamodule = PosttrainDataModule(source, tokenizer, batch_size=1, train_collate=None, eval_split=cfg.eval.split,
                                     eval_num_prompts=cfg.eval.num_prompts, eval_batch_size=cfg.eval.batch_size)
    if not datamodule.eval_examples:
        raise DataError(f"eval.split={cfg.eval.split!r} has no examples to evaluate on")
    precision, precision_change = cpu_precision(cfg.trainer.precision, cfg.trainer.accelerator)
    if precision_change is not None:
        print(precision_change, flush=True)
    trainer = L.Trainer(accelerator=cfg.trainer.accelerator, devices=1, precision=precision,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(output_dir))

    greedy = trainer.validate(module, datamodule=datamodule, verbose=False)[0]
    results = {"eval/accuracy": float(greedy["eval/accuracy"]), "eval/response_len": float(greedy["eval/response_len"])}
    # calibration of the greedy responses (PosttrainModule.log_calibration): ECE, mean confidence, reliability bins
    results.update({k: float(v) for k, v in greedy.items() if k in ("eval/ece", "eval/confidence")
                    or k.startswith("eval/reliability/")})
    # the suites' metrics (eval/<suite>/<metric>) and the accuracy per source (eval/<source>/accuracy)
    suites = [suite.name for suite in module.eval_suites]
    results.update({k: float(v) for k, v in greedy.items() if k.split("/")[1] in suites or is_source_key(k)})

    def predict_sampled(num_samples: int) -> list:
        """module.predict_step over the held-out prompts, `num_samples` responses each."""
        module.num_samples = num_samples
        prompts_per_batch = max(1, cfg.eval.batch_size // num_samples)  # rows per generate call ~ eval.batch_size
        loader = DataLoader(datamodule.eval_examples, batch_size=prompts_per_batch, shuffle=False,
                            collate_fn=lambda examples: collate_prompts(examples, tokenizer))
        return trainer.predict(module, dataloaders=loader)

    if cfg.pass_k:
        num_correct = torch.cat(predict_sampled(cfg.num_samples))
        for k in cfg.pass_k:
            results[f"eval/pass@{k}"] = float(pass_at_k(cfg.num_samples, num_correct, k).mean())
    if thinking_budgets:
        # greedy responses with at most `budget` reasoning tokens each (rollout/thinking.py)
        loader = DataLoader(datamodule.eval_examples, batch_size=cfg.eval.batch_size, shuffle=False,
                            collate_fn=lambda examples: collate_prompts(examples, tokenizer))
        for budget in thinking_budgets:
            module.thinking = (budget, end_ids)
            correct, length, forced = torch.cat(trainer.predict(module, dataloaders=loader)).mean(dim=0).tolist()
            results.update({f"eval/thinking@{budget}/accuracy": correct, f"eval/thinking@{budget}/response_len": length,
                            f"eval/thinking@{budget}/forced_frac": forced})
        module.thinking = None
        results.update(thinking_budgets=thinking_budgets, end_of_thinking=marker)
    if best_of_n_sizes:
        started = time.perf_counter()
        module.judges = build_judges(cfg.best_of_n, policy)
        judged = Judged.join(predict_sampled(max(best_of_n_sizes)))
        results.update(best_of_n_accuracies(judged, best_of_n_sizes, seed=cfg.seed))
        results.update(best_of_n_samples=max(best_of_n_sizes), best_of_n_prm=cfg.best_of_n.prm,
                       best_of_n_orm=cfg.best_of_n.orm, best_of_n_seconds=round(time.perf_counter() - started, 2))
    results.update(
        checkpoint=str(cfg.checkpoint), weights=str(weights.path),
        run_dir=None if weights.run_dir is None else str(weights.run_dir),
        split=cfg.eval.split, num_prompts=len(datamodule.eval_examples), greedy_max_new_tokens=cfg.eval.max_new_tokens,
        num_samples=cfg.num_samples if cfg.pass_k else 0, temperature=cfg.temperature, seed=cfg.seed,
        suites={suite.name: {"num_prompts": len(suite.examples), "samples": suite.samples,
                             "temperature": suite.sampling.temperature, "metrics": list(suite.metrics)}
                for suite in module.eval_suites},
        settings=OmegaConf.to_container(OmegaConf.masked_copy(cfg, ["model", "data", "eval", "rollout", "trainer"])),
    )
    write_json_atomic(output_dir / "eval.json", results)
    print_results(results, list(cfg.pass_k or []), best_of_n_sizes)
    log.info(f"wrote {output_dir / 'eval.json'}")
    return results


def print_results(results: dict, pass_k: list[int], best_of_n_sizes: list[int]) -> None:
    from rich.table import Table  # start-up: only the results print tables

    from posttrain.eval.best_of_n import best_of_n_table
    from posttrain.run.console import render

    log.info(f"evaluated {results['weights']}")
    table = Table(title=f"{results['num_prompts']} held-out prompts ({results['split']})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("accuracy (greedy)", f"{results['eval/accuracy']:.1%}")
    table.add_row("response_len (greedy)", f"{results['eval/response_len']:.2f} tok")
    if "eval/ece" in results:
        table.add_row("confidence (greedy)", f"{results['eval/confidence']:.1%}")
        bins = sum(key.startswith("eval/reliability/") and key.endswith("/share") for key in results)
        table.add_row(f"ECE (greedy, {bins} bins)", f"{results['eval/ece']:.3f}")
    for k in pass_k:
        table.add_row(f"pass@{k} (n={results['num_samples']}, T={results['temperature']:g})",
                      f"{results[f'eval/pass@{k}']:.1%}")
    for budget in results.get("thinking_budgets", []):
        table.add_row(f"accuracy (greedy, thinking budget {budget}; forced "
                      f"{results[f'eval/thinking@{budget}/forced_frac']:.0%})",
                      f"{results[f'eval/thinking@{budget}/accuracy']:.1%}")
    for key in sorted(k for k in results if k.startswith("eval/") and k.count("/") == 2
                      and k.split("/")[1] not in results.get("suites", {}) and k.endswith("/accuracy")):
        table.add_row(f"accuracy (greedy), source {key.split('/')[1]}", f"{results[key]:.1%}")
    log.info(render(table))  # through the logger: also in eval.log
    if results.get("suites"):
        log.info(render(suites_table(results), width=120))  # a column per metric: wider
    if best_of_n_sizes:
        title = (f"best-of-n accuracy: {results['num_prompts']} prompts, {results['best_of_n_samples']} samples "
                 f"each (T={results['temperature']:g})")
        for name in ("prm", "orm"):
            if results[f"best_of_n_{name}"] is not None:
                title += f", {name}={results[f'best_of_n_{name}']}"
        log.info(render(best_of_n_table(results, best_of_n_sizes, title), width=120))  # 8 columns: wider


def is_source_key(key: str) -> bool:
    """Whether `key` is `eval/<source>/accuracy` of the held-out examples' sources."""
    # start-up: it loads torch, which the results are read after
    from posttrain.algorithms.eval_suites import EVAL_NAMESPACES

    parts = key.split("/")
    return len(parts) == 3 and parts[2] == "accuracy" and parts[1] not in EVAL_NAMESPACES


def suites_table(results: dict):
    """A row per evaluation suite: its prompts, decoding and each of its metrics."""
    from rich.table import Table  # start-up: only the results print tables

    suites = results["suites"]
    metrics = list(dict.fromkeys(m for suite in suites.values() for m in suite["metrics"]))
    table = Table(title="evaluation suites (eval.suites)")
    for column in ("suite", "prompts", "decoding", *metrics):
        table.add_column(column, justify="left" if column == "suite" else "right")
    for name, suite in suites.items():
        decoding = "greedy" if suite["samples"] == 1 else f"{suite['samples']} at T={suite['temperature']:g}"
        cells = []
        for metric in metrics:
            value = results.get(f"eval/{name}/{metric}")
            cells.append("" if value is None else f"{value:.2f}" if metric == "response_len" else f"{value:.1%}")
        table.add_row(name, str(suite["num_prompts"]), decoding, *cells)
    return table


main = hydra_command("posttrain-eval", "evaluate", evaluate, log_name="eval.log")

if __name__ == "__main__":
    main()
