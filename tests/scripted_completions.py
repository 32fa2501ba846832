"""A scripted stand-in for vLLM's token API, for tests where the policy must act sensibly:
``/v1/completions`` answers with the token ids of a known reply, as vLLM would.

The reply is chosen by the conversation, not by a counter, so concurrent trajectories each get
their own script: reply ``n`` goes to a prompt holding ``n`` finished assistant turns (ChatML
``<|im_start|>assistant``, the last one being the generation prompt). The ids are the policy
tokenizer's encoding of the reply plus ``<|im_end|>``, each with logprob ``LOGPROB``; a reply
longer than ``max_tokens`` is cut there with ``finish_reason: length``. ``/health`` and
``/v1/models`` answer as vLLM's do. Every request is kept in ``requests``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tokenizers import Tokenizer

LOGPROB = -0.125
ASSISTANT_TURN = "<|im_start|>assistant"
END_OF_TURN = "<|im_end|>"


class ScriptedCompletions:
    def __init__(self, model_dir: Path, served: str, replies: list[str]):
        self.tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        self.served = served
        self.replies = replies
        self.requests: list[dict] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def complete(self, body: dict) -> dict:
        self.requests.append(body)
        prompt = self.tokenizer.decode(body["prompt"], skip_special_tokens=False)
        turn = min(prompt.count(ASSISTANT_TURN) - 1, len(self.replies) - 1)
        ids = self.tokenizer.encode(self.replies[turn]).ids + [self.tokenizer.token_to_id(END_OF_TURN)]
        finish = "stop"
        if len(ids) > body["max_tokens"]:
            ids, finish = ids[: body["max_tokens"]], "length"
        return {"id": f"cmpl-{len(self.requests)}", "object": "text_completion", "model": self.served,
                "choices": [{"index": 0, "text": self.tokenizer.decode(ids, skip_special_tokens=False), "token_ids": ids,
                             "logprobs": {"token_logprobs": [LOGPROB] * len(ids)}, "finish_reason": finish,
                             "prompt_token_ids": body["prompt"]}],
                "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(ids)}}


def _handler(scripted: ScriptedCompletions) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def _reply(self, payload: dict, status: int = 200) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._reply({})
            elif self.path == "/v1/models":
                self._reply({"object": "list", "data": [{"id": scripted.served, "object": "model"}]})
            else:
                self._reply({"error": "not found"}, 404)

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            if self.path != "/v1/completions":
                self._reply({"error": "not found"}, 404)
            else:
                self._reply(scripted.complete(body))

    return Handler


@contextmanager
def scripted_completions(model_dir: Path, served: str, replies: list[str]) -> Iterator[ScriptedCompletions]:
    scripted = ScriptedCompletions(model_dir, served, replies)
    thread = threading.Thread(target=scripted.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield scripted
    finally:
        scripted.server.shutdown()
        scripted.server.server_close()
        thread.join(5)
