"""`expertstream bench serve`: Open WebUI's traffic replayed against a live `expertstream serve`.

Starts the server on a free port (the model and `--serve-args` as given), then measures:
- the chat's time to first token and decode rate with Open WebUI's 36 default tools attached, alone and with
  the background tasks Open WebUI sends around it: a title task (non-streaming, `max_tokens` 1000) two
  seconds before the first message, follow-ups and tags tasks (no token limit) just before the next one;
- aggregate decode throughput at 1, 2 and 4 concurrent requests, against the expert bytes the engine
  fetched per step (each step fetches the union of the running requests' experts, once per layer).
Each measured chat starts a new conversation, so the state cache holds none of its prompt.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from expertstream.bench.openwebui import openwebui_tools, task_prompt

USERS = (
    "Tell me about the first days of the world.",
    "Who was Moses?",
    "What is wisdom?",
    "Sing me a psalm of praise.",
    "What did the prophets foretell?",
)
FOLLOW_UP = "And what came after that?"
# plain-text openings for the throughput rows (completions: no template, so replies run their length)
OPENINGS = ("In the beginning", "And it came to pass", "Blessed is the man", "The LORD is my shepherd")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`expertstream serve` in a child process, ready once /health answers 200."""

    def __init__(self, model: str, serve_args: list[str], log_path: Path | None):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "expertstream",
            "serve",
            *([model] if model else []),
            "--port",
            str(self.port),
            "--log-level",
            "WARNING",
            *serve_args,
        ]
        log = open(log_path, "w") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
        deadline = time.monotonic() + 600
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited with status {self.proc.returncode}: {' '.join(cmd)}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise SystemExit("the server did not become ready in 600 s")
            time.sleep(0.5)
        self.model_id = httpx.get(self.url + "/v1/models").json()["data"][0]["id"]

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def stream_chat(url: str, body: dict) -> dict:
    """One streaming request: time to first token (s), completion tokens, decode tokens/s, the text."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    t0, first, text, usage = time.perf_counter(), None, "", None
    with httpx.stream("POST", url + path, json=body, timeout=None) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                raise SystemExit(f"the server reported an error: {chunk['error']['message']}")
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                piece = choice.get("text") or ""
                delta = choice.get("delta") or {}
                piece += (delta.get("content") or "") + (delta.get("reasoning_content") or "")
                if (piece or delta.get("tool_calls")) and first is None:
                    first = time.perf_counter()
                text += piece
    end = time.perf_counter()
    tokens = usage["completion_tokens"] if usage else 0
    first = first or end
    return dict(
        ttft=first - t0,
        tokens=tokens,
        tps=(tokens - 1) / max(end - first, 1e-9),
        text=text,
        start=t0,
        first=first,
        end=end,
        prompt_tokens=usage["prompt_tokens"] if usage else 0,
    )


def task(url: str, model: str, kind: str, history: list[dict], max_tokens: int | None, out: list) -> None:
    """A background task as Open WebUI sends it (non-streaming); appends (kind, seconds, tokens) to out."""
    body = {"model": model, "messages": [{"role": "user", "content": task_prompt(kind, history)}]}
    if max_tokens:
        body["max_tokens"] = max_tokens
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=None).json()
    if "error" in r:  # the table says why in place of its token count
        out.append((kind, time.perf_counter() - t0, f"failed: {r['error']['message']}"))
        return
    out.append((kind, time.perf_counter() - t0, r["usage"]["completion_tokens"]))


def _background(*calls) -> list[threading.Thread]:
    threads = [threading.Thread(target=fn, args=a, daemon=True) for fn, *a in calls]
    for t in threads:
        t.start()
    return threads


def chat_rows(
    url: str, model: str, chat_tokens: int, lead_s: float, title_tokens: int = 1000
) -> tuple[list[dict], list]:
    """The first message and a follow-up, alone and then with Open WebUI's tasks around them."""
    tools = openwebui_tools()

    def body(messages):
        return {"model": model, "messages": messages, "tools": tools, "max_tokens": chat_tokens}

    rows, tasks = [], []
    for with_tasks, user in ((False, USERS[1]), (True, USERS[2])):
        first = [{"role": "user", "content": user}]
        threads = []
        if with_tasks:  # the title task, then the chat `lead_s` later (Open WebUI's order)
            threads = _background((task, url, model, "title", first, title_tokens, tasks))
            time.sleep(lead_s)
        r1 = stream_chat(url, body(first))
        history = first + [{"role": "assistant", "content": r1["text"]}]
        if with_tasks:
            threads += _background(
                (task, url, model, "follow_ups", history, None, tasks),
                (task, url, model, "tags", history, None, tasks),
            )
            time.sleep(0.2)
        r2 = stream_chat(url, body(history + [{"role": "user", "content": FOLLOW_UP}]))
        for t in threads:
            t.join()
        label = "with tasks" if with_tasks else "alone"
        rows.append(dict(turn="first message", tasks=label, **r1))
        rows.append(dict(turn="follow-up", tasks=label, **r2))
    return rows, tasks


COUNTERS = {  # /metrics counter -> the column it feeds
    "expertstream_expert_cache_hits_total": "lookups",
    "expertstream_expert_cache_misses_total": "lookups",
    "expertstream_expert_bus_bytes_total": "bus",
    'expertstream_disk_read_bytes_total{kind="experts"}': "disk",
}
GAUGES = {  # /metrics gauge -> its column (the value after the row; absent off CUDA)
    'expertstream_gpu_memory_bytes{kind="reserved"}': "reserved",
    'expertstream_gpu_memory_bytes{kind="decode_graphs"}': "graphs",
}


def _counters(url: str) -> dict[str, float]:
    """Expert lookups of the RAM store, bytes over the bus to the GPU, expert bytes read from disk; the VRAM
    the allocator reserves and the decode graphs' pool of it (None off CUDA)."""
    out: dict = dict.fromkeys(COUNTERS.values(), 0.0) | dict.fromkeys(GAUGES.values())
    for line in httpx.get(url + "/metrics").text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in COUNTERS:
            out[COUNTERS[name]] += float(value)
        elif name in GAUGES:
            out[GAUGES[name]] = float(value)
    return out


def throughput_rows(url: str, model: str, tokens: int, block_bytes: int | None) -> list[dict]:
    """N requests started together (completions of plain-text openings, greedy, `tokens` each)."""
    rows = []
    for n in (1, 2, 4):
        before, results = _counters(url), [None] * n

        def one(i, results):
            body = {"model": model, "prompt": OPENINGS[i], "max_tokens": tokens, "temperature": 0}
            results[i] = stream_chat(url, body)

        threads = _background(*[(one, i, results) for i in range(n)])
        for t in threads:
            t.join()
        after = _counters(url)
        moved = {k: after[k] - before[k] for k in set(COUNTERS.values())}
        total = sum(r["tokens"] for r in results)
        span = max(r["end"] for r in results) - min(r["first"] for r in results)
        steps = max(r["tokens"] for r in results)  # the batch steps once per token of its longest request
        rows.append(
            dict(
                n=n,
                tokens=total,
                tps=(total - n) / max(span, 1e-9),
                blocks_per_step=moved["lookups"] / steps,
                mb_per_step=moved["lookups"] * block_bytes / steps / 1e6 if block_bytes else None,
                bus_mb_per_step=moved["bus"] / steps / 1e6,
                disk_mb_per_step=moved["disk"] / steps / 1e6,
                reserved_gib=after["reserved"] / 2**30 if after["reserved"] is not None else None,
                graphs_mib=after["graphs"] / 2**20 if after["graphs"] is not None else None,
            )
        )
    return rows


def table(rows: list[dict], tasks: list, tput: list[dict], tools_tokens: int) -> str:
    alone = {r["turn"]: r["ttft"] for r in rows if r["tasks"] == "alone"}
    out = [
        f"Chat with Open WebUI's 36 default tools ({tools_tokens} prompt tokens on the first message):",
        "",
        "| turn | tasks | prompt tokens | time to first token (s) | vs alone | tokens | decode tok/s |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = r["ttft"] / alone[r["turn"]]
        out.append(
            f"| {r['turn']} | {r['tasks']} | {r['prompt_tokens']} | {r['ttft']:.2f} | {ratio:.2f}x | "
            f"{r['tokens']} | {r['tps']:.1f} |"
        )
    out += [
        "",
        "Background tasks: "
        + ", ".join(f"{k} {s:.1f} s ({n}{' tokens' * isinstance(n, int)})" for k, s, n in tasks),
        "",
        "| concurrent requests | tokens | aggregate decode tok/s | expert blocks per step | MB per step | "
        "bus MB per step | disk MB per step | VRAM reserved (GiB) | decode graphs' pool (MiB) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    for r in tput:
        out.append(
            f"| {r['n']} | {r['tokens']} | {r['tps']:.1f} | {r['blocks_per_step']:.0f} | "
            f"{num(r['mb_per_step'], '.1f')} | {r['bus_mb_per_step']:.1f} | {r['disk_mb_per_step']:.1f} | "
            f"{num(r['reserved_gib'], '.2f')} | {num(r['graphs_mib'], '.0f')} |"
        )
    return "\n".join(out) + "\n"


def run(args) -> int:
    from expertstream.bench.cli import emit
    from expertstream.default_model import resolve_model
    from expertstream.workdir.workdir import Workdir

    model = resolve_model(args.model)
    block = Workdir(model).layout.block_bytes
    server = Server(model, (args.serve_args or "").split(), args.serve_log)
    try:
        url, model_id = server.url, server.model_id
        stream_chat(
            url, {"model": model_id, "messages": [{"role": "user", "content": USERS[0]}], "max_tokens": 4}
        )
        rows, tasks = chat_rows(url, model_id, args.chat_tokens, args.task_lead, args.title_tokens)
        tput = throughput_rows(url, model_id, args.tokens or 32, block)
    finally:
        server.close()
    tools_tokens = rows[0]["prompt_tokens"]
    text = table(rows, tasks, tput, tools_tokens)
    first = {r["tasks"]: r["ttft"] for r in rows if r["turn"] == "first message"}
    payload = dict(
        chats=[{k: v for k, v in r.items() if k != "text"} for r in rows],
        tasks=tasks,
        throughput=tput,
        title_ratio=first["with tasks"] / first["alone"],
    )
    emit(args, "bench serve (Open WebUI's flow)", f"server: {args.serve_args or 'defaults'}", text, payload)
    return 0
