"""Shared test inputs: tiny Wan transformer calls, relative-error metrics, gate predictions, example loading."""

import contextlib
import importlib.util
import subprocess
import sys
import threading
from pathlib import Path

import diffusers.hooks.hooks
import torch

from diffusers_trtllm.backends.base import VarlenQKV
from diffusers_trtllm.tiny_pipelines import TINY_TEXT_DIM, TINY_TEXT_LEN, tiny_cosmos3_pipeline, tiny_wan_transformer

#: diffusers' ``cache_context`` publishes the step index and sigma (0.41 and later); 0.40 publishes the name only
PUBLISHES_STEPS = hasattr(diffusers.hooks.hooks, "CacheContext")
I2V_IMAGE_DIM = 24
I2V_IMAGE_TOKENS = 257


def pipeline_context(model, name: str = "cond", step: int = 0, sigma: float = 0.5):
    """``model.cache_context(...)`` as diffusers' Wan pipeline opens it around a transformer call (the name only
    under diffusers 0.40; nothing where the model has no ``cache_context``: Cosmos 3 under diffusers 0.40)."""
    if not hasattr(model, "cache_context"):
        return contextlib.nullcontext()
    return model.cache_context(name, step_index=step, sigma=sigma) if PUBLISHES_STEPS else model.cache_context(name)


def max_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).abs().max() / ref.abs().max()).item()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def wan_inputs(batch=2, frames=3, height=16, width=16, i2v=False, timestep=500):
    inputs = dict(hidden_states=torch.randn(batch, 16, frames, height, width),
                  timestep=torch.full((batch,), timestep, dtype=torch.long),
                  encoder_hidden_states=torch.randn(batch, TINY_TEXT_LEN, TINY_TEXT_DIM), return_dict=False)
    if i2v:
        inputs["encoder_hidden_states_image"] = torch.randn(batch, I2V_IMAGE_TOKENS, I2V_IMAGE_DIM)
    return inputs


def tiny_wan(i2v=False, **kwargs):
    extra = dict(image_dim=I2V_IMAGE_DIM, added_kv_proj_dim=32) if i2v else {}
    return tiny_wan_transformer(**extra, **kwargs)


def predicted_gate_modes(scheduler, gate: float, *, from_sigmas: bool | None = None) -> dict[int, str]:
    """Per step of ``scheduler`` (timesteps already set): "skip" where t <= gate, else "dense" — what the timestep
    gate must do. t is the step's sigma where the pipeline publishes it (diffusers' Wan and Cosmos 3 pipelines
    from 0.41 on: ``from_sigmas`` None), else (``from_sigmas=False``: HunyuanVideo 1.5, custom loops, a bare
    transformer) the timestep argument / num_train_timesteps."""
    if PUBLISHES_STEPS if from_sigmas is None else from_sigmas:
        values = scheduler.sigmas[:len(scheduler.timesteps)].tolist()
    else:
        train = scheduler.config.num_train_timesteps
        values = [t / train for t in scheduler.timesteps.tolist()]
    return {i: "skip" if t <= gate else "dense" for i, t in enumerate(values)}


def load_script(relative: str):
    """Import a repository script (``examples/demo.py``) as a module."""
    name = "script_" + Path(relative).stem
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / relative)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the script runs
    spec.loader.exec_module(module)
    return module


def cosmos3_transformer_call(height: int = 32, width: int = 32):
    """The tiny Cosmos 3 transformer and the keyword arguments its pipeline passes it (the packed inputs are
    easiest to get from the pipeline itself)."""
    pipe = tiny_cosmos3_pipeline()
    pipe.set_progress_bar_config(disable=True)
    captured = []
    hook = pipe.transformer.register_forward_pre_hook(lambda m, a, kw: captured.append(kw) if not captured else None,
                                                      with_kwargs=True)
    pipe("a fox", height=height, width=width, num_frames=1, num_inference_steps=1, output_type="latent",
         generator=torch.Generator().manual_seed(0))
    hook.remove()
    return pipe.transformer, captured[0]


class LoopPipeline:
    """The shape of a diffusers pipeline call, without encoders or VAE: ``set_timesteps``, then per timestep one
    transformer call with that timestep and ``scheduler.step``. ``publish``: each transformer call inside
    ``transformer.cache_context("cond", step_index=i, sigma=...)`` and ``maybe_free_model_hooks``' reset at the
    end, as diffusers' Wan and Cosmos 3 pipelines do; without it, a custom loop that publishes nothing."""

    def __init__(self, transformer, scheduler, publish: bool = False):
        self.transformer, self.scheduler, self.publish = transformer, scheduler, publish

    def __call__(self, inputs: dict, steps: int, begin: int = 0) -> torch.Tensor:
        self.scheduler.set_timesteps(steps)
        self.scheduler.set_begin_index(begin)
        latents = inputs["hidden_states"]
        batch = latents.shape[0]
        for i, t in enumerate(self.scheduler.timesteps[begin:], start=begin):
            call = {**inputs, "timestep": t.expand(batch)}
            if self.publish:
                with pipeline_context(self.transformer, "cond", i, float(self.scheduler.sigmas[i])):
                    self.transformer(**call)
            else:
                self.transformer(**call)
            latents = self.scheduler.step(torch.zeros_like(latents), t, latents).prev_sample
        if self.publish:
            self.transformer._reset_stateful_cache()
        return latents


def run_script_under_triton_interpreter(test_file: str, *paths) -> object:
    """Run ``test_file`` as a script with ``paths`` as its arguments and load what it saved at the last. The
    script's ``__main__`` sets ``TRITON_INTERPRET=1`` before Triton is imported, which a pytest process that
    already imported Triton cannot do."""
    proc = subprocess.run([sys.executable, test_file, *map(str, paths)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(paths[-1], weights_only=False)


def run_cases_under_triton_interpreter(test_file: str, cases, folder) -> object:
    """Save ``cases`` in ``folder`` and run ``test_file`` on them under the Triton interpreter
    (:func:`run_script_under_triton_interpreter` with ``cases.pt`` and ``results.pt``); its results."""
    torch.save(cases, folder / "cases.pt")
    return run_script_under_triton_interpreter(test_file, folder / "cases.pt", folder / "results.pt")


@contextlib.contextmanager
def op_run(*settings: torch.Tensor, calls=None, device="cpu"):
    """A counting run whose site ``i`` runs ``settings[i]`` (a call's own settings, given the run's key and site
    ``i`` here), open in this thread while the block runs; yields it (``run.counts_of(i)``: site ``i``'s counters,
    ``run.error_sums[i]``: its probe's sums)."""
    from diffusers_trtllm.run_state import OWNER, SETTINGS, SITE, Run, RunKey, set_run_here

    key = RunKey()
    run = Run.start(key.value, calls if calls is not None else (None,) * len(settings), torch.device(device),
                    counting=True)
    for index, own in enumerate(settings):
        own[OWNER], own[SITE] = key.value, index
        run.settings[index] = own[:SETTINGS]
    set_run_here(key.value, run)
    try:
        yield run
    finally:
        set_run_here(key.value, None)


@contextlib.contextmanager
def counted_run(*calls, device="cpu"):
    """A counting run of these calls (planned outside a handle, e.g. a processor's unbound calls), open in this
    thread while the block runs; yields it (``run.counts_of(i)``: call ``i``'s counters)."""
    for index, call in enumerate(calls):
        call.index, call.counting = index, True
    with op_run(*(call.settings for call in calls), calls=calls, device=device) as run:
        yield run


def counted_op(*args):
    """``torch.ops.diffusers_trtllm.attention(*args)`` in a counting run of its own (its ``settings``, ``args[4]``,
    are the run's one site): (output, the call's counts, its probe's sums)."""
    with op_run(args[4]) as run:
        out = torch.ops.diffusers_trtllm.attention(*args)
    return out, run.counts_of(0), run.error_sums[0]


def run_together(jobs: dict) -> dict:
    """Run ``{name: callable}`` at the same time in threads, starting together; their results by name."""
    results, errors = {}, []
    barrier = threading.Barrier(len(jobs))

    def run(name):
        try:
            barrier.wait()
            results[name] = jobs[name]()
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(name,)) for name in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


def peaky_qkv(seqlens_q, seqlens_kv, heads_q: int, heads_kv: int, seed: int | None = 4, k_mean: bool = False):
    """bf16 CUDA inputs where each query favours keys near its own position (position features shared by Q and K
    over noise): tiles far from a query tile are negligible at moderate λ, near ones are not, few sit at the
    threshold. ``seed`` None: fresh random inputs; ``k_mean``: K offset by a per-head mean (for SAGE's smoothing)."""
    gen = torch.Generator(device="cuda").manual_seed(int(torch.seed()) % 2**31 if seed is None else seed)
    freqs = torch.logspace(-3, -0.5, 64, device="cuda")[None, :]

    def rows(lengths, heads):
        pos = torch.cat([torch.arange(n, device="cuda", dtype=torch.float32) for n in lengths])[:, None]
        feature = torch.cat([torch.sin(pos * freqs), torch.cos(pos * freqs)], 1)[:, None]
        return (feature + 0.3 * torch.randn(pos.shape[0], heads, 128, device="cuda", generator=gen)) * 2

    v = torch.randn(sum(seqlens_kv), heads_kv, 128, device="cuda", generator=gen)
    q, k = rows(seqlens_q, heads_q), rows(seqlens_kv, heads_kv)
    if k_mean:
        k = k + torch.randn(1, heads_kv, 128, device="cuda", generator=gen)
    return VarlenQKV(q.bfloat16(), k.bfloat16(), v.bfloat16(), tuple(seqlens_q), tuple(seqlens_kv))
