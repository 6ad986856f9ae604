"""Shared fixtures (loaded as a plugin by tests/conftest.py): tiny random Llama-family models saved by HF transformers, the real SmolLM2,
and a teardown that checks every engine's block accounting is back to idle."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import ipaddress
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.loader import load_model

TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama-gqa-tied": dict(
        arch="llama", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True
    ),
    "llama-mha-untied": dict(
        arch="llama", num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False
    ),
    "llama3-rope-scaled": dict(
        arch="llama",
        num_attention_heads=4,
        num_key_value_heads=1,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "qwen2-bias": dict(
        arch="qwen2", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False
    ),
    "mistral-window": dict(
        arch="mistral", num_attention_heads=4, num_key_value_heads=2, sliding_window=24
    ),
    # head_dim 64 (two int8 KV scale groups of 32 per row; the others have head_dim 16)
    "llama-hd64": dict(arch="llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1),
}


def make_tiny_model(path: Path, name: str, seed: int = 0) -> Path:
    """Create and save a random tiny model with HF transformers (the reference implementation)."""
    import transformers

    spec = dict(TINY_CONFIGS[name])
    arch = spec.pop("arch")
    cls_cfg, cls_model = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[arch]
    base = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        # NOTE: a wide init makes next-token distributions peaked, so greedy argmax is far from
        # ties and token equality tests the computation, not rounding luck.
        initializer_range=0.3,
        bos_token_id=1,
        eos_token_id=2,
    )
    base.update(spec)
    cfg = cls_cfg(**base)
    if arch == "qwen2":
        cfg.use_sliding_window = False
    torch.manual_seed(seed)
    model = cls_model(cfg).eval()
    if arch == "qwen2":  # biases start at zero; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0, 0.3)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def get(name: str = "llama-gqa-tied") -> Path:
        if name not in made:
            made[name] = make_tiny_model(tmp_path_factory.mktemp(name), name)
        return made[name]

    return get


@pytest.fixture
def make_engine(tiny_model_dir: Callable[[str], Path]) -> Iterator[Callable[..., Engine]]:
    """Build engines on tiny models; at teardown every engine must be idle with exact accounting.
    fp32 unless a test names its dtype (``auto``: bf16 matrix products where the CPU has native
    bf16, ``services.engine.precision``)."""
    engines: list[Engine] = []

    def make(model: str = "llama-gqa-tied", **cfg: Any) -> Engine:
        loaded = load_model(tiny_model_dir(model))
        eng = Engine(
            loaded,
            None,
            EngineConfig(**{"num_kv_blocks": 64, "block_size": 4, "dtype": "float32", **cfg}),
        )
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        eng.check_integrity()
        assert eng.blocks.num_used_blocks == 0, "blocks still in use after the test"
        assert not eng.has_unfinished


@pytest.fixture(scope="session")
def smollm_engine() -> Engine:
    # NOTE: fp32 over the dequantized GGUF: the token-for-token reference check against
    # transformers (the served default keeps the GGUF quantized; tests/engine/test_quant.py)
    return Engine.from_path(
        None, EngineConfig(num_kv_blocks=256, quantization="none", dtype="float32")
    )


@pytest.fixture(scope="session")
def smollm_hf() -> Any:
    """transformers' own GGUF loader on the same file: the independent fp32 reference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.engine.loader import default_model_path

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return tok, model.eval()


def hf_greedy(
    model: Any, prompt: list[int], max_new_tokens: int, eos: int | None = None
) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


_HANDED_OUT: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A loopback port free now, below the kernel's ephemeral range, and never the same twice in
    one test process. A Ray cluster opens many sockets whose ports come from that range (servers
    on port 0, the local ends of outgoing connections), so a port taken from it could be gone
    by the time a server binds it (seen in CI: a gateway's gRPC port, between the test choosing
    it and the server starting)."""
    import random
    import socket

    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(500):
        port = rng.randrange(max(1024, low - 12000), low) if low > 3072 else 0
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = s.getsockname()[1]
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError("no free loopback port below the ephemeral range")


def start_redis(
    port: int,
    password: str | None = None,
    workdir: Path | None = None,
    tls: tuple[Path, Path, Path] | None = None,
) -> Any:
    """Start a real redis-server on loopback and wait until it answers; returns the Popen.

    ``tls``: (certificate, key, CA) files: the server then speaks TLS only, on ``port``."""
    import shutil
    import subprocess
    import time

    import redis

    exe = shutil.which("redis-server")
    assert exe, "redis-server is not installed (deploy/setup.sh installs it)"
    args = [exe, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    args += ["--port", str(port)] if tls is None else ["--port", "0", "--tls-port", str(port)]
    ping: dict[str, Any] = {}
    if tls is not None:
        cert, key, ca = tls
        args += ["--tls-cert-file", str(cert), "--tls-key-file", str(key)]
        args += ["--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no"]
        ping["ssl_ca_certs"] = str(ca)
    if password:
        args += ["--requirepass", password]
    if workdir is not None:
        args += ["--dir", str(workdir)]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    auth = f":{password}@" if password else ""
    scheme = "rediss" if tls is not None else "redis"
    deadline = time.monotonic() + 20
    while True:
        try:
            url = f"{scheme}://{auth}127.0.0.1:{port}/0"
            redis.Redis.from_url(url, socket_timeout=0.5, **ping).ping()
            return proc
        except redis.RedisError:
            assert proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.1)


def eventually(check: Callable[[], Any], timeout_s: float, what: str, every_s: float = 0.05) -> Any:
    """Call ``check`` until it returns something truthy (returned) or the deadline passes (the
    test fails naming ``what``): the one way tests wait on another process's state."""
    import time

    deadline = time.monotonic() + timeout_s
    while not (result := check()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(every_s)
    return result


def wait_until_ok(url: str, timeout_s: float, proc: Any = None) -> None:
    """Poll ``url`` until it answers 200; fail if ``proc`` exits or the deadline passes."""
    import httpx

    def ok() -> bool:
        assert proc is None or proc.poll() is None, f"the server exited while waiting for {url}"
        try:
            return httpx.get(url, timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    eventually(ok, timeout_s, f"{url} answering 200", every_s=1)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server on a free loopback port, with a password; stopped by its pid."""
    port = free_port()
    proc = start_redis(port, "s3cret", tmp_path_factory.mktemp("redis"))
    yield f"redis://:s3cret@127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)


def make_tls_certs(tmp: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 signed by it, as PEM files in ``tmp``:
    (server certificate, server key, CA certificate)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def cert(subject, key, issuer, issuer_key, ca):  # type: ignore[no-untyped-def]
        b = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            b = b.add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False,
            )
        return b.sign(issuer_key, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = cert("pdserve test CA", ca_key, "pdserve test CA", ca_key, True)
    server = cert("127.0.0.1", key, "pdserve test CA", ca_key, False)
    paths = tmp / "server.crt", tmp / "server.key", tmp / "ca.crt"
    paths[0].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
    )
    paths[2].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    return paths


class TcpProxy:
    """A loopback TCP proxy to ``127.0.0.1:upstream_port`` whose ``drop()`` cuts every open
    connection at once, as a network failure would (both directions, no goodbye)."""

    def __init__(self, upstream_port: int) -> None:
        import socket
        import threading

        self.upstream_port = upstream_port
        self.connections = 0
        self._open: list[Any] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        while True:
            try:
                down, _ = self._listener.accept()
            except OSError:
                return  # closed
            up = socket.create_connection(("127.0.0.1", self.upstream_port))
            with self._lock:
                self.connections += 1
                self._open += [down, up]
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: Any, dst: Any) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.close()

    def drop(self) -> None:
        import socket

        with self._lock:
            socks, self._open = self._open, []
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        self._listener.close()
        self.drop()


def prefill_for_handoff(engine: Engine, rid: str, prompt: list[int], params: Any) -> Any:
    """Prefill ``prompt`` on ``engine`` as a prefill replica does (its KV handed to a real
    ``Outbox``; the test holds the engine, so the engine lock is a no-op) and take the KV as a
    receiver would: the handle with block data, then released. Returns (outputs, handle)."""
    from kvtransfer.outbox import Outbox

    box = Outbox(engine.fingerprint, contextlib.nullcontext)
    entry = box.open(rid, len(prompt), False)
    engine.add_request(rid, prompt, params, prefill_only=True, kv_sink=entry)
    outs = []
    while engine.has_unfinished:
        outs += [o for o in engine.step() if o.request_id == rid]
    handle = box.get(rid, entry.secret)
    assert engine.stats().num_held == (handle is not None)
    box.release(rid, entry.secret)
    return outs, handle


@functools.cache
def narrower_kernel_builds() -> dict[str, Any]:
    """pdserve's C kernels built for narrower SIMD paths than this CPU's: ``avx2`` (no
    AVX-512) and ``portable`` (no AVX2 / FMA either), each checked to report its level (an
    AVX2 build on a host without AVX2 is portable). Built once per test process (about 3 s
    each; some 27 tests use them), in a scratch folder removed at exit."""
    from services.engine.cpu_kernels import library

    root = Path(tempfile.mkdtemp(prefix="pdserve-kernels-"))
    atexit.register(shutil.rmtree, root, True)
    cc = library.compiler()
    assert cc is not None
    has_avx2 = library.simd_level() != "portable"
    narrower = {  # name: (flags, the SIMD level that build must report)
        "avx2": (("-mno-avx512f",), 2 if has_avx2 else 0),
        "portable": (("-mno-avx512f", "-mno-avx2", "-mno-fma"), 0),
    }
    libs = {}
    for name, (flags, level) in narrower.items():
        lib = library.bind(library._build(cc, flags, root))
        assert lib.pdserve_kernels_simd() == level, name
        libs[name] = lib
    return libs
