"""The engine: one per replica, driven by ``add_request`` / ``step``.

Request lifecycle inside one engine:
1. ``add_request`` validates everything (raising InvalidRequestError before any block is
   taken), hashes the prompt's full blocks and queues the request.
2. ``step`` asks the scheduler for a batch, copies in imported KV handles, runs the model on
   every scheduled token at once, samples, checks stop conditions and streams
   ``RequestOutput`` deltas.
3. A finished request frees its blocks (full ones stay in the prefix cache). A prefill-only
   request instead stops after its first token and calls its ``kv_sink``'s hooks (layer
   computed, prefilled, aborted); at ``prefilled`` the sink may keep the blocks pinned until
   it frees them (``PinnedKV``). The handoff's lifecycle (lease, release, receivers) is the
   sink's: the prefill replica's ``kvtransfer.outbox.Outbox``.
4. A decode-side request starts from a ``KVHandle``: its blocks are placed in this engine's
   cache and it continues exactly where the prefill engine stopped.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from services.engine.backend import get_backend
from services.engine.bandwidth import read_gbps
from services.engine.block_hash import hash_block, hash_blocks, salted_root
from services.engine.block_manager import BlockManager
from services.engine.config import EngineConfig, ModelConfig
from services.engine.cpu_backend import supports as cpu_backend_supports
from services.engine.cpu_decode import MAX_BATCH, FusedDecode
from services.engine.cuda_graphs import DecodeGraphs
from services.engine.errors import InvalidRequestError, LayoutMismatchError, UnknownRequestError
from services.engine.grammar import Grammars
from services.engine.kv_cache import KVCache
from services.engine.kv_handle import KVHandle, LayoutFingerprint
from services.engine.kv_quant import resolve_kv_dtype
from services.engine.kv_stream import KVPiece, KVSink
from services.engine.loader import LoadedModel, load_model
from services.engine.memory import activation_bytes, blocks_for_memory
from services.engine.model import LayerHook, LlamaModel
from services.engine.model_runner import ModelRunner
from services.engine.precision import (
    DTYPES,
    prepare_weights,
    prompt_attention_dtype,
    resolve_dtype,
    resolve_matmul_dtype,
    resolve_quantization,
)
from services.engine.quant import kernel_rows
from services.engine.request import FinishReason, Request, RequestOutput, Status
from services.engine.sampler import History, sample
from services.engine.sampling_params import SamplingParams, check_prompt
from services.engine.scheduler import ScheduledSpan, Scheduler
from services.engine.step_log import StepLog
from services.engine.step_state import StepState
from services.engine.stop import StopChecker
from services.engine.tokenizer import IncrementalDetokenizer, Tokenizer


def step_params(mc: ModelConfig) -> int:
    """Weights one decode step multiplies by: every layer's linears and the lm_head."""
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    h, inter = mc.hidden_size, mc.intermediate_size
    return mc.num_layers * (h * (q + 2 * kv) + q * h + 3 * h * inter) + mc.vocab_size * h


def can_prepack(device: str, dtype: torch.dtype) -> bool:
    """oneDNN packs weights on CPU; in bf16 / fp16 only where the CPU has the instructions
    its kernels need (AVX-512 or AVX-NE-CONVERT; it raises otherwise)."""
    if device != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return True


def resolve_batch_invariant(
    setting: bool | str, backend: str, matmul_dtype: torch.dtype = torch.float32
) -> bool:
    """``auto`` -> on with the ``cpu`` attention backend, whose every kernel computes a row on
    its own, where the matmuls run in fp32 (invariance then costs decode about 11% at 32
    concurrent requests); off where they run in bf16 (on AMX generated rows would forgo the
    AMX GEMM at every batch: 2.9x fewer tokens/s at 32 concurrent, BENCHMARKS.md; on
    AVX512-BF16 without AMX the decode rows of up to 32 run the same kernels either way, not
    re-measured as a default), where ``true`` still gives it. Elsewhere (GPU kernels pick
    tilings and reduction splits by batch size) it is not implemented, and asking for it is an
    error rather than a promise not kept."""
    if setting == "auto":
        return backend == "cpu" and matmul_dtype == torch.float32
    if setting and backend != "cpu":
        raise ValueError(
            f"batch_invariant is implemented by the 'cpu' attention backend only, not by "
            f"{backend!r}; use batch_invariant auto or false"
        )
    return bool(setting)


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_held: int  # prefilled requests whose blocks a KV handoff keeps pinned
    blocks_total: int
    blocks_free: int  # free or evictable
    blocks_used: int
    blocks_cached: int
    prompt_tokens_computed: int  # prefill work actually done (cache hits excluded)
    prefill_tokens_queued: int  # prompt tokens admitted but not computed yet (routing load)
    prefix_hit_tokens: int
    num_preemptions: int
    num_steps: int
    num_draft_tokens: int = 0  # speculative draft tokens verified
    num_accepted_tokens: int = 0  # of which accepted (acceptance rate = accepted / draft)


class Engine:
    """Llama-family engine over a paged KV cache. See the module docstring for the lifecycle."""

    def __init__(
        self, loaded: LoadedModel, tokenizer: Tokenizer | None, config: EngineConfig
    ) -> None:
        self.dtype_name = resolve_dtype(config.dtype, config.device)
        self.matmul_dtype_name = resolve_matmul_dtype(config.dtype, config.device)
        self.quantization = resolve_quantization(config.quantization, config.device)
        torch.set_num_threads(config.threads)
        self.config = config
        self.model_config = loaded.config
        self.model_id = loaded.model_id
        self.tokenizer = tokenizer
        self.max_model_len = min(
            config.max_model_len or loaded.config.max_position_embeddings,
            loaded.config.max_position_embeddings,
        )
        dtype, matmul_dtype = DTYPES[self.dtype_name], DTYPES[self.matmul_dtype_name]
        pack = config.prepack_weights and can_prepack(config.device, matmul_dtype)
        self.model = LlamaModel.from_state_dict(
            loaded.config,
            prepare_weights(loaded.state_dict, self.quantization),
            max_positions=self.max_model_len,
            dtype=dtype,
            device=config.device,
            pack=matmul_dtype if pack else None,
        )
        mc = loaded.config
        self.backend = get_backend(
            config.attention_backend,
            config.device,
            dtype,
            mc.head_dim,
            prompt_attention_dtype(matmul_dtype, config.device),
        )
        if self.backend.name == "cpu" and not cpu_backend_supports(dtype, mc.head_dim):
            # NOTE: its C kernels read and write fp32 rows: any other dtype corrupts memory
            raise ValueError(
                f"attention_backend cpu runs fp32 models with head_dim <= 512 where its kernels "
                f"build, not dtype {self.dtype_name} (head_dim {mc.head_dim}); use dtype "
                "float32, or attention_backend torch or auto"
            )
        # NOTE: auto follows the matrix products' dtype only where the backend converts the
        # cache's rows (a backend that cannot stores the model's dtype, as before)
        self.kv_dtype = resolve_kv_dtype(
            config.kv_cache_dtype,
            self.matmul_dtype_name if self.backend.kv_conversion else self.dtype_name,
        )
        if self.kv_dtype != self.dtype_name and not self.backend.kv_conversion:
            raise ValueError(
                f"kv_cache_dtype {self.kv_dtype} under a {self.dtype_name} model is not "
                f"implemented by the {self.backend.name!r} attention backend; use kv_cache_dtype "
                "auto, or attention_backend torch or cpu"
            )
        self.batch_invariant = resolve_batch_invariant(
            config.batch_invariant, self.backend.name, matmul_dtype
        )
        num_blocks = self._num_kv_blocks(config, dtype)
        capacity = num_blocks * config.block_size
        if config.max_model_len is not None and config.max_model_len > capacity:
            raise ValueError(
                f"max_model_len {config.max_model_len} does not fit this replica's KV cache: "
                f"{num_blocks} blocks of {config.block_size} tokens hold {capacity}; lower "
                "max_model_len, or raise num_kv_blocks / gpu_memory_utilization"
            )
        # NOTE: the default (the model's) is capped by what one request can ever hold, so a
        # request that leaves max_tokens out asks for what fits
        self.max_model_len = min(self.max_model_len, capacity)
        self.cache = KVCache(
            mc.num_layers,
            num_blocks,
            config.block_size,
            mc.num_kv_heads,
            mc.head_dim,
            dtype,
            config.device,
            self.kv_dtype,
        )
        self.blocks = BlockManager(
            num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        self.scheduler = Scheduler(config, self.blocks)
        self.step_state = StepState(
            self.blocks,
            config.max_num_seqs,
            self.max_model_len,
            self.cache.scratch_block,
            config.device,
            mc.sliding_window,
            self.batch_invariant,
        )
        graphs = None
        on_cuda = torch.device(config.device).type == "cuda"
        if config.cuda_graphs and on_cuda and self.backend.graph_safe:
            graphs = DecodeGraphs(
                self.model,
                self.cache,
                self.step_state,
                self.backend,
                config.max_num_seqs,
                capture=True,
            )
            graphs.capture_all()  # at start, as padding only: no request waits for a capture
        fused = None
        if FusedDecode.supported(self.model, self.backend.name):
            # NOTE: by role, generated rows run the kernels at any batch: every pure decode
            # step of up to MAX_BATCH rows fuses; by size, only those the kernels win, except
            # speculative verification steps (FusedDecode.fits)
            rows = (
                MAX_BATCH if self.batch_invariant else kernel_rows(matmul_dtype if pack else None)
            )
            fused = FusedDecode(self.model, self.cache, self.max_model_len, rows)
        self.runner = ModelRunner(
            self.model, self.cache, self.step_state, self.backend, graphs, fused
        )
        self.fingerprint = LayoutFingerprint(
            self.model_id,
            mc.num_layers,
            mc.num_kv_heads,
            mc.head_dim,
            config.block_size,
            self.kv_dtype,  # the storage format: what the blocks' bytes mean
        )
        eos = set(mc.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.grammars = Grammars(tokenizer, mc.vocab_size, self.eos_token_ids)
        self.step_log = StepLog()
        self._requests: dict[str, Request] = {}
        self._aborted: list[Request] = []
        self._prompt_tokens_computed = 0
        self._prefix_hit_tokens = 0
        self._num_preemptions = 0
        self._num_steps = 0
        # prefilled requests whose blocks a KV handoff keeps (``_Pinned``), until it frees them
        self._pinned: dict[str, Request] = {}
        self._draft_tokens = 0  # speculative draft tokens verified
        self._accepted_tokens = 0  # of which accepted

    @classmethod
    def from_path(
        cls, path: str | Path | None = None, config: EngineConfig | None = None
    ) -> Engine:
        """Load a GGUF file or HF folder (None: the embedded default) and build an engine."""
        config = config or EngineConfig()
        keep = resolve_quantization(config.quantization, config.device) != "none"
        loaded = load_model(path, keep_quantized=keep)
        tok = (
            Tokenizer.from_folder(loaded.folder)
            if (loaded.folder / "tokenizer.json").is_file()
            else None
        )
        return cls(loaded, tok, config)

    # ---- requests ------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        prefill_only: bool = False,
        kv_handle: KVHandle | None = None,
        kv_sink: KVSink | None = None,
    ) -> None:
        """Queue a request.

        Args:
            prefill_only: stop after the first token and hand the KV to ``kv_sink``
                (without one it is freed). Forced on for role ``prefill``.
            kv_handle: continue a request prefilled elsewhere (roles ``decode`` and ``both``);
                ``prompt_ids`` must equal the handle's prompt.
            kv_sink: the KV handoff's hooks (prefill-only requests; see
                ``services.engine.kv_stream.KVSink``).
        Raises:
            InvalidRequestError: naming the bad field; nothing is allocated.
            LayoutMismatchError: the handle's layout differs from this engine's.
        """
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id", "must be a non-empty string")
        if request_id in self._requests or request_id in self._pinned:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        params.validate()
        prompt = list(prompt_ids)
        self._validate_prompt(prompt, params)
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop", "stop strings need a tokenizer; this model has none")
        if params.response_format is not None:
            self.grammars.check(params.response_format)
        prefill_only = prefill_only or self.config.role == "prefill"
        if kv_handle is not None:
            if self.config.role == "prefill":
                raise InvalidRequestError(
                    "kv_handle", "a prefill-only engine does not accept KV handles"
                )
            self._validate_handle(kv_handle, prompt)
        if kv_sink is not None and not prefill_only:
            raise InvalidRequestError("kv_sink", "only a prefill-only request streams its KV")
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        req = Request(
            request_id,
            prompt,
            params,
            seed,
            prefill_only=prefill_only,
            kv_import=kv_handle,
            kv_sink=kv_sink,
        )
        if self.tokenizer is not None:
            req.detok = IncrementalDetokenizer(self.tokenizer)
        if kv_handle is not None:
            first = kv_handle.token_ids[-1]
            req.token_ids.append(first)
            req.sent_tokens = req.num_tokens  # the prefill side already streamed it
            if kv_handle.first_logprob is not None:
                req.logprobs.append(kv_handle.first_logprob)
                if params.top_logprobs:
                    # NOTE: a placeholder keeping positions aligned; the prefill side already
                    # sent the first token's alternatives, this side never outputs them
                    req.top_logprobs.append(())
            if req.detok is not None:
                req.text = req.detok.push(first)
                req.sent_text = len(req.text)
            req.timings.last_token = req.timings.arrival
        req.block_hashes = hash_blocks(
            req.token_ids, self.config.block_size, salted_root(params.cache_salt)
        )
        if (
            kv_handle is not None
            and tuple(req.block_hashes[: len(kv_handle.block_hashes)]) != kv_handle.block_hashes
        ):
            raise InvalidRequestError(
                "kv_handle", "block hashes do not match the handle's token ids"
            )
        self._requests[request_id] = req
        self.scheduler.add(req)

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks; its final output (ABORT) comes from the next step.
        Returns False if the request is unknown or already finished."""
        req = self._requests.get(request_id)
        if req is None or req.finished:
            return False
        self.scheduler.remove(req)
        self.blocks.free(request_id)
        req.status = Status.FINISHED
        req.finish_reason = FinishReason.ABORT
        self.grammars.drop(request_id)
        if req.kv_sink is not None:
            req.kv_sink.aborted("the request was aborted")
        self._aborted.append(req)
        return True

    # ---- the loop ------------------------------------------------------------------------
    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or bool(self._aborted)

    def step(self) -> list[RequestOutput]:
        """Run one batch; returns an update for every request that produced tokens or ended."""
        outputs = [self._output(r) for r in self._aborted]
        for r in self._aborted:
            self._requests.pop(r.request_id, None)
        self._aborted.clear()
        sched = self.scheduler.schedule()
        self._num_preemptions += len(sched.preempted)
        for req in sched.preempted:
            req.stream_next = -1  # recomputed from scratch: the cached part is sent again
        for req, new_blocks, first in sched.imports:
            assert req.kv_import is not None
            handle = req.kv_import
            self.cache.write_blocks(
                new_blocks, handle.blocks[:, :, first : first + len(new_blocks)]
            )
            self._prefix_hit_tokens += first * self.config.block_size
            req.kv_import = None  # NOTE: drop the copy now; a later preemption recomputes
        if not sched.spans:
            return outputs
        self._num_steps += 1
        now = step_start = time.perf_counter()
        # NOTE: this thread's CPU time: the step's wall time less what it waited for (a core,
        # the GIL, or on a GPU the device)
        cpu_start = time.thread_time()
        for s in sched.spans:
            if s.request.timings.first_scheduled is None:
                s.request.timings.first_scheduled = now
                if s.request.num_preemptions == 0 and s.request.sent_tokens == 0:
                    self._prefix_hit_tokens += s.start
        prompt_tokens = sum(
            min(s.start + s.num_new, s.request.num_prompt) - s.start
            for s in sched.spans
            if s.start < s.request.num_prompt
        )
        self._prompt_tokens_computed += prompt_tokens
        scoring = [(s, s.prompt_positions) for s in sched.spans if s.prompt_positions]
        logits = self.runner.run(sched.spans, self._stream_hook(sched.spans))
        if scoring:
            n_scored = sum(len(r) for _, r in scoring)
            self._score_prompts(scoring, logits[logits.shape[0] - n_scored :])
            logits = logits[: logits.shape[0] - n_scored]
        # NOTE: counted once, here: a span's `samples` changes as tokens are appended below
        sampling = [(s, s.num_sampled) for s in sched.spans if s.samples]
        # one row per sampled position; a speculative span samples each draft position too,
        # with the seed of the output index it would have without speculation (lossless)
        rows = [(s, j) for s, n in sampling for j in range(n)]
        sampled = sample(
            logits,
            [s.request.params for s, _ in rows],
            [s.request.seed for s, _ in rows],
            [s.request.num_tokens - s.request.num_prompt + j for s, j in rows],
            self.eos_token_ids,
            _histories(rows),
            [
                self.grammars.allowed(s.request) if s.request.params.response_format else None
                for s, _ in rows
            ],
        )
        tokens, logprobs, top = sampled.tokens, sampled.logprobs, sampled.top
        failed = {id(rows[r][0]): why for r, why in sampled.errors.items()}
        emitted = self._verify(sampling, tokens)
        bs = self.config.block_size
        for s in sched.spans:
            # KV is valid through the real tokens and the accepted draft tokens
            accepted = len(emitted[id(s)]) - 1 if id(s) in emitted else 0
            s.request.num_computed = s.start + s.num_new - len(s.draft) + accepted
            s.request.stream_next = s.request.num_computed
            self.blocks.cache_blocks(
                s.request.request_id, s.request.block_hashes[: s.request.num_computed // bs]
            )
        now = time.perf_counter()
        decoding = sum(1 for s in sched.spans if s.start >= s.request.num_prompt)
        self.step_log.record(
            decoding, prompt_tokens, now - step_start, time.thread_time() - cpu_start
        )
        row = 0
        for s, n in sampling:
            if id(s) in failed:  # fails alone: its blocks are freed, its batch goes on
                s.request.error = failed[id(s)]
                self._finish(s.request, FinishReason.ERROR)
                row += n
                outputs.append(self._output(s.request))
                continue
            for j, token in enumerate(emitted[id(s)]):
                lp = None if logprobs is None else logprobs[row + j]
                alts = None if top is None else top[row + j]
                self._append_token(s.request, token, lp, now, alts)
                if s.request.finished:
                    break
            row += n
            outputs.append(self._output(s.request))
        return outputs

    @staticmethod
    def _score_prompts(scoring: list[tuple[ScheduledSpan, range]], logits: torch.Tensor) -> None:
        """Append each scored position's prompt log-probability (of the prompt token after it)
        and its alternatives, from the model's unmodified distribution."""
        lp = torch.log_softmax(logits.float(), dim=-1)
        targets = [s.request.token_ids[p + 1] for s, r in scoring for p in r]
        chosen = lp[torch.arange(len(targets)), torch.tensor(targets)].tolist()
        k = max(s.request.params.prompt_logprobs or 0 for s, _ in scoring)
        alts: list[list[int]] = []
        vals: list[list[float]] = []
        if k:
            v, i = lp.topk(k, dim=-1)
            vals, alts = v.tolist(), i.tolist()
        row = 0
        for s, r in scoring:
            req, want = s.request, s.request.params.prompt_logprobs or 0
            for _ in r:
                top = tuple(zip(alts[row][:want], vals[row][:want], strict=True)) if want else ()
                req.prompt_logprobs.append((chosen[row], top))
                row += 1

    def _verify(
        self, sampling: list[tuple[ScheduledSpan, int]], tokens: list[int]
    ) -> dict[int, list[int]]:
        """The tokens each sampling span emits: its first sampled token, then for each draft
        token equal to the token sampled before it, the token sampled at its position. Each is
        exactly the token decoding one by one would sample there."""
        out: dict[int, list[int]] = {}
        row = 0
        for s, n in sampling:
            emit = [tokens[row]]
            for j, d in enumerate(s.draft):
                if tokens[row + j] != d:
                    break
                emit.append(tokens[row + j + 1])
            self._draft_tokens += len(s.draft)
            self._accepted_tokens += len(emit) - 1
            out[id(s)] = emit
            row += n
        return out

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[list[int]]:
        """Run ``prompts`` to completion together; returns each one's output token ids."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        ids = [f"gen-{secrets.token_hex(6)}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
        out: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished:
            for o in self.step():
                if o.request_id in out:
                    out[o.request_id].extend(o.new_token_ids)
        return [out[rid] for rid in ids]

    def profile(self) -> dict[str, object]:
        """What this engine is, for a reader that diagnoses it (``pdserve doctor``): its
        precision, its KV pool and its step budget, and the bytes one decode step reads.
        NOTE: it measures this host's read bandwidth (a 64 MB pass, about 30 ms): replicas
        call it once, at start."""
        mc, cfg = self.model_config, self.config
        block = KVCache.bytes_per_block(
            mc.num_layers, cfg.block_size, mc.num_kv_heads, mc.head_dim, self.kv_dtype
        )
        return {
            "model": self.model_id,
            "role": cfg.role,
            "device": cfg.device,
            "dtype": self.dtype_name,
            "matmul_dtype": self.matmul_dtype_name,
            "quantization": self.quantization,
            "kv_cache_dtype": self.kv_dtype,
            "weight_bytes": self.model.weight_bytes,
            # parameters one decode step reads (every linear and the lm_head; the embedding
            # gathers a few rows): the bytes per step at another precision follow from it
            "step_params": step_params(mc),
            "read_gbps": read_gbps(cfg.device),
            "kv_bytes_per_token": block // cfg.block_size,
            "block_size": cfg.block_size,
            "num_kv_blocks": self.blocks.num_blocks,
            "max_model_len": self.max_model_len,
            "max_num_seqs": cfg.max_num_seqs,
            "max_num_batched_tokens": cfg.max_num_batched_tokens,
            "speculative_tokens": cfg.speculative_tokens,
        }

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_held=len(self._pinned),
            blocks_total=self.blocks.num_blocks,
            blocks_free=self.blocks.num_free_blocks,
            blocks_used=self.blocks.num_used_blocks,
            blocks_cached=self.blocks.num_cached_blocks,
            prompt_tokens_computed=self._prompt_tokens_computed,
            prefill_tokens_queued=sum(
                max(0, r.num_prompt - r.num_computed)
                for r in (*self.scheduler.waiting, *self.scheduler.running)
            ),
            prefix_hit_tokens=self._prefix_hit_tokens,
            num_preemptions=self._num_preemptions,
            num_steps=self._num_steps,
            num_draft_tokens=self._draft_tokens,
            num_accepted_tokens=self._accepted_tokens,
        )

    def check_integrity(self) -> None:
        self.blocks.check_integrity()

    # ---- internals -----------------------------------------------------------------------
    def _num_kv_blocks(self, config: EngineConfig, dtype: torch.dtype) -> int:
        """``num_kv_blocks``, or on CUDA with ``gpu_memory_utilization`` what fits on the
        device next to the weights already loaded and the activations of a full step."""
        dev = torch.device(config.device)
        if dev.type != "cuda" or config.gpu_memory_utilization is None:
            return config.num_kv_blocks
        mc = self.model_config
        free, total = torch.cuda.mem_get_info(dev)
        return blocks_for_memory(
            total=total,
            free=free,
            utilization=config.gpu_memory_utilization,
            bytes_per_block=KVCache.bytes_per_block(
                mc.num_layers, config.block_size, mc.num_kv_heads, mc.head_dim, self.kv_dtype
            ),
            activation_bytes=activation_bytes(mc, config, dtype),
        )

    def _handle(self, req: Request, blocks: torch.Tensor) -> KVHandle:
        return KVHandle(
            request_id=req.request_id,
            token_ids=tuple(req.token_ids),
            num_computed=req.num_computed,
            fingerprint=self.fingerprint,
            block_hashes=tuple(req.block_hashes[: req.num_computed // self.config.block_size]),
            blocks=blocks,
            first_logprob=req.logprobs[0] if req.logprobs else None,
        )

    def _stream_hook(self, spans: Sequence[ScheduledSpan]) -> LayerHook | None:
        """The layer hook of a step that has streaming requests (None: it has none). Sends
        the cached positions before a span first, when the sink does not have them yet."""
        rows: list[tuple[KVSink, int, int, int]] = []  # sink, first row, last row, position
        row = 0
        for s in spans:
            sink = s.request.kv_sink
            if sink is not None and sink.wants_layers:
                if s.start != s.request.stream_next:
                    self._stream_cached(s.request, sink, s.start)
                rows.append((sink, row, row + s.num_new, s.start))
            row += s.num_new
        if not rows:
            return None

        encode = self.cache.encode

        def hook(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            for sink, a, b, start in rows:
                # NOTE: a copy (stack), taken before the next layer runs: the sender reads it
                # from its own thread while the engine goes on. In the cache's storage format:
                # int8 rows are a pure function of the values, so these are the cache's bytes.
                data = torch.stack((encode(k[a:b]), encode(v[a:b])))
                sink.layer_computed(KVPiece(layer, start, start + b - a, data))

        return hook

    def _stream_cached(self, req: Request, sink: KVSink, end: int) -> None:
        """Positions [0, end) of every layer, read from the cache (prefix hits, recomputes)."""
        if end == 0:
            return
        bs = self.config.block_size
        table = self.blocks.block_table(req.request_id)
        pos = torch.arange(end)
        blocks = torch.tensor(table[: self.blocks.blocks_needed(end)], dtype=torch.long)
        slots = (blocks[pos // bs] * bs + pos % bs).to(self.cache.k[0].device)
        for layer in range(self.model_config.num_layers):
            k, v = self.cache.flat(layer)  # [kv_heads, slots, row]: the storage format
            data = torch.stack((k.index_select(1, slots), v.index_select(1, slots)))
            sink.layer_computed(KVPiece(layer, 0, end, data.transpose(1, 2).contiguous()))

    def _validate_prompt(self, prompt: list[int], params: SamplingParams) -> None:
        check_prompt(prompt, params, self.model_config.vocab_size, self.max_model_len)
        need = self.blocks.blocks_needed(len(prompt) + params.max_tokens)
        if need > self.blocks.num_blocks:
            raise InvalidRequestError(
                "max_tokens",
                f"the request needs {need} KV blocks; this engine has {self.blocks.num_blocks}",
            )

    def _validate_handle(self, handle: KVHandle, prompt: list[int]) -> None:
        if handle.fingerprint != self.fingerprint:
            raise LayoutMismatchError(
                f"KV layout mismatch for {handle.request_id!r}: {handle.fingerprint.describe_mismatch(self.fingerprint)}"
            )
        if handle.num_computed != len(prompt) or list(handle.token_ids[:-1]) != prompt:
            raise InvalidRequestError(
                "kv_handle", "the handle's prompt differs from the request's prompt"
            )
        mc = self.model_config
        want = (
            mc.num_layers,
            2,
            self.blocks.blocks_needed(handle.num_computed),
            self.config.block_size,
            mc.num_kv_heads,
            self.cache.k[0].shape[-1],  # the storage row (head_dim values for float formats)
        )
        if tuple(handle.blocks.shape) != want:
            raise InvalidRequestError(
                "kv_handle", f"blocks have shape {tuple(handle.blocks.shape)}, expected {want}"
            )

    def _append_token(
        self,
        req: Request,
        token: int,
        logprob: float | None,
        now: float,
        top: tuple[tuple[int, float], ...] | None = None,
    ) -> None:
        req.token_ids.append(token)
        bs = self.config.block_size
        if req.num_tokens % bs == 0:
            parent = (
                req.block_hashes[-1] if req.block_hashes else salted_root(req.params.cache_salt)
            )
            req.block_hashes.append(hash_block(parent, req.token_ids[-bs:]))
        if logprob is not None and req.params.logprobs:
            req.logprobs.append(logprob)
            if req.params.top_logprobs:
                req.top_logprobs.append(top or ())
        t = req.timings
        if t.first_token is None:
            t.first_token = now
        if t.last_token is not None:
            t.itls.append(now - t.last_token)
        t.last_token = now
        if req.detok is not None:
            req.text += req.detok.push(token)
        reason = StopChecker.check(req, token, self.eos_token_ids, self.max_model_len)
        if reason is None and req.params.response_format is not None:
            state = self.grammars.advance(req)
            if state == "complete":  # the output is whole: nothing but EOS could follow
                reason = FinishReason.STOP
            elif state is not None:
                req.error = state
                reason = FinishReason.ERROR
        if reason is None and req.prefill_only:
            reason = FinishReason.PREFILLED
        if reason is not None:
            self._finish(req, reason)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        self.grammars.drop(req.request_id)
        req.finish_reason = reason
        req.status = Status.FINISHED
        self.scheduler.remove(req)
        sink = req.kv_sink
        if reason is FinishReason.PREFILLED and sink is not None:
            final = self._handle(req, torch.empty(0, dtype=self.cache.k[0].dtype))
            if sink.prefilled(final, _Pinned(self, req)):
                self._pinned[req.request_id] = req
                return
        elif sink is not None:
            sink.aborted(f"the request finished at its first token ({reason})")
        self.blocks.free(req.request_id)

    def _read_pinned(self, req: Request) -> torch.Tensor:
        if self._pinned.get(req.request_id) is not req:
            raise UnknownRequestError(f"no pinned KV for request {req.request_id!r}")
        n_blocks = self.blocks.blocks_needed(req.num_computed)
        return self.cache.read_blocks(self.blocks.block_table(req.request_id)[:n_blocks])

    def _free_pinned(self, req: Request) -> None:
        if self._pinned.get(req.request_id) is req:
            del self._pinned[req.request_id]
            self.blocks.free(req.request_id)

    def _output(self, req: Request) -> RequestOutput:
        new_ids = req.token_ids[max(req.sent_tokens, req.num_prompt) :]
        req.sent_tokens = req.num_tokens
        visible = len(req.text) if req.finished else StopChecker.visible_len(req)
        new_text = req.text[req.sent_text : visible]
        req.sent_text = max(req.sent_text, visible)
        first_lp = req.num_tokens - len(new_ids) - req.num_prompt
        t = req.timings
        prompt_lps = None
        if (
            req.params.prompt_logprobs is not None
            and not req.prompt_logprobs_sent
            and new_ids
            and len(req.prompt_logprobs) == req.num_prompt - 1  # this engine scored it
        ):
            prompt_lps = list(req.prompt_logprobs)
            req.prompt_logprobs_sent = True
        if req.finished:
            self._requests.pop(req.request_id, None)
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=new_ids,
            new_text=new_text,
            new_logprobs=req.logprobs[first_lp:] if req.params.logprobs else None,
            finished=req.finished,
            finish_reason=req.finish_reason,
            num_prompt_tokens=req.num_prompt,
            num_output_tokens=req.num_tokens - req.num_prompt,
            num_cached_tokens=req.num_cached_tokens,
            queue_s=t.queue_s,
            prefill_s=t.prefill_s,
            ttft_s=t.ttft_s,
            error=req.error,
            itls=list(t.itls) if req.finished else None,
            new_top_logprobs=req.top_logprobs[first_lp:] if req.params.top_logprobs else None,
            prompt_logprobs=prompt_lps,
        )


class _Pinned:
    """A prefilled request's blocks, pinned for its KV handoff (``PinnedKV``): read and freed
    under the engine lock by the sink that kept them."""

    __slots__ = ("_engine", "_req")

    def __init__(self, engine: Engine, req: Request) -> None:
        self._engine, self._req = engine, req

    def read(self) -> torch.Tensor:
        return self._engine._read_pinned(self._req)

    def free(self) -> None:
        self._engine._free_pinned(self._req)


def _histories(rows: list[tuple[ScheduledSpan, int]]) -> list[History | None] | None:
    """Per sampled row, its tokens so far when its params penalize them: the request's, then
    the draft tokens before the row's position (the row is used only if they are accepted,
    so it sees what decoding one by one would)."""
    if not any(s.request.params.penalized for s, _ in rows):
        return None
    return [
        ([*s.request.token_ids, *s.draft[:j]], s.request.num_prompt)
        if s.request.params.penalized
        else None
        for s, j in rows
    ]
