"""One Cline task over ProtoBus: configure the provider and settings, start the task, follow it.

Invariants:
- The provider is OpenAI-compatible, pointed at the given base URL with the given key, for both
  plan and act mode; the mode is ACT; telemetry is ``disabled``; checkpoints, MCP marketplace and
  remote config are off; yolo mode and auto-approval of reads, edits and commands are on; tools
  are Cline's XML format (native tool calling off), whatever the model id.
- The welcome view is marked completed and the current announcement shown, so nothing waits to
  be dismissed.
- Auto-approval settings only take when their ``version`` exceeds the stored one: it is read back
  and increased.
- The task's messages are the merge, by timestamp, of ``subscribeToState`` (only states whose
  current task is ours: the first state sent can still be an older task's) and
  ``subscribeToPartialMessage`` (the final version of a message that first appeared partial may
  come only there).
- The task ends ``completed`` on a completion_result (say or ask), ``failed`` on api_req_failed,
  mistake_limit_reached or yolo's "Task failed" error, ``unanswerable_ask`` on any other ask but
  approvals (approvals are answered yes), and ``timeout`` at the deadline, after ``cancelTask``.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from .protobus import ProtoBus

CHECKED_SETTINGS = ("mode", "telemetrySetting", "yoloModeToggled", "welcomeViewCompleted", "shouldShowAnnouncement")
APPROVAL_ASKS = {"tool", "command", "command_output", "browser_action_launch", "use_mcp_server"}
FAILURE_ASKS = {"api_req_failed", "mistake_limit_reached"}
IGNORED_ASKS = {"resume_task", "resume_completed_task"}  # what a cancelled or reopened task shows


@dataclass(frozen=True)
class ProviderSettings:
    base_url: str
    api_key: str
    model: str
    max_tokens: int = 4096
    context_window: int = 128000
    max_consecutive_mistakes: int = 3


def configure(bus: ProtoBus, provider: ProviderSettings) -> dict:
    """Configure Cline; return the settings it reports afterwards (``CHECKED_SETTINGS`` and the
    auto-approved actions), so the run's metrics show what was in force."""
    openai = bus.enum_value("cline.ApiProvider", "OPENAI")
    info = bus.message("cline.OpenAiCompatibleModelInfo", max_tokens=provider.max_tokens,
                       context_window=provider.context_window, supports_images=False, supports_prompt_cache=False,
                       input_price=0, output_price=0)
    model = provider.model
    api = bus.message("cline.ModelsApiConfiguration", open_ai_base_url=provider.base_url, open_ai_api_key=provider.api_key,
                      plan_mode_api_provider=openai, act_mode_api_provider=openai,
                      plan_mode_api_model_id=model, act_mode_api_model_id=model,
                      plan_mode_open_ai_model_id=model, act_mode_open_ai_model_id=model,
                      plan_mode_open_ai_model_info=info, act_mode_open_ai_model_info=info)
    bus.call("cline.ModelsService", "updateApiConfigurationProto", api_configuration=api)
    bus.call("cline.StateService", "updateSettings", telemetry_setting="disabled",
             mode=bus.enum_value("cline.PlanActMode", "ACT"), enable_checkpoints_setting=False, yolo_mode_toggled=True,
             native_tool_call_enabled=False, mcp_marketplace_enabled=False, opt_out_of_remote_config=True,
             max_consecutive_mistakes=provider.max_consecutive_mistakes)
    bus.call("cline.StateService", "setWelcomeViewCompleted", value=True)
    bus.call("cline.UiService", "onDidShowAnnouncement")
    stored = json.loads(bus.call("cline.StateService", "getLatestState").state_json).get("autoApprovalSettings") or {}
    actions = bus.message("cline.AutoApprovalActions", read_files=True, read_files_externally=False, edit_files=True,
                          edit_files_externally=False, execute_safe_commands=True, execute_all_commands=True,
                          use_browser=False, use_mcp=False)
    bus.call("cline.StateService", "updateAutoApprovalSettings", version=int(stored.get("version", 1)) + 1,
             actions=actions, enable_notifications=False)
    state = json.loads(bus.call("cline.StateService", "getLatestState").state_json)
    approved = (state.get("autoApprovalSettings") or {}).get("actions") or {}
    return {**{key: state.get(key) for key in CHECKED_SETTINGS},
            "autoApproved": sorted(action for action, on in approved.items() if on)}


def message_from_proto(bus: ProtoBus, proto: Any) -> dict:
    """A ``cline.ClineMessage`` in the shape of state_json's ``clineMessages``. Proto enum names
    differ from the JSON strings (``COMPLETION_RESULT_SAY`` is ``completion_result``), and
    ``ask``/``say`` mean something only as ``type`` says (proto3's default 0 is a real value)."""
    kind = "ask" if proto.type == bus.enum_value("cline.ClineMessageType", "ASK") else "say"
    message = {"ts": proto.ts, "type": kind, "text": proto.text, "partial": proto.partial}
    if kind == "ask":
        message["ask"] = bus.enum_name("cline.ClineAsk", proto.ask).lower()
    else:
        name = bus.enum_name("cline.ClineSay", proto.say).lower()
        message["say"] = name.removesuffix("_say")
    return message


def task_end(message: dict | None) -> tuple[str, str] | None:
    """(outcome, detail) if ``message``, the task's last, ends it; else None. Approvals do not."""
    if not message or message.get("partial"):
        return None
    ask, say, text = message.get("ask"), message.get("say"), message.get("text") or ""
    if message.get("type") == "say":
        if say == "completion_result":
            return "completed", text[:500]
        if say == "error" and "Task failed" in text:
            return "failed", text[:500]
        return None
    if ask == "completion_result":
        return "completed", ""
    if ask in FAILURE_ASKS:
        return "failed", f"{ask}: {text[:500]}"
    if ask in APPROVAL_ASKS or ask in IGNORED_ASKS:
        return None
    return "unanswerable_ask", f"{ask}: {text[:500]}"


@dataclass
class TaskRun:
    task_id: str = ""
    outcome: str = ""  # set when the task ends, or "timeout" at the deadline
    detail: str = ""
    started_at: float = 0.0
    first_message_s: float | None = None  # newTask -> the first streamed message of the task
    approvals: int = 0
    messages: list[dict] = field(default_factory=list)

    def metrics(self) -> dict:
        says = [m.get("say") for m in self.messages]
        return {"task_id": self.task_id, "outcome": self.outcome, "detail": self.detail,
                "task_s": round(time.monotonic() - self.started_at, 3) if self.started_at else None,
                "first_message_s": self.first_message_s,
                "api_requests": says.count("api_req_started"), "messages": len(self.messages), "approvals": self.approvals}


def run_task(bus: ProtoBus, text: str, deadline: float, run: TaskRun) -> None:
    """Start the task and follow it into ``run`` until it ends or ``deadline`` (monotonic)
    passes; then it is cancelled. ``run`` is filled in as it goes, so a caller interrupted
    mid-way still has the task id."""
    events: queue.Queue = queue.Queue()
    streams = [bus.stream("cline.StateService", "subscribeToState"), bus.stream("cline.UiService", "subscribeToPartialMessage")]
    for name, stream in zip(("state", "partial"), streams):
        threading.Thread(target=_pump, args=(name, stream, events), daemon=True).start()
    try:
        time.sleep(0.3)  # the subscriptions register before the task starts
        run.started_at = time.monotonic()
        run.task_id = bus.call("cline.TaskService", "newTask", text=text).value
        _follow(bus, events, deadline, run)
        if not run.outcome:
            run.outcome = "timeout"
            bus.call("cline.TaskService", "cancelTask", timeout_s=10)
    finally:
        for stream in streams:
            stream.cancel()


def _follow(bus: ProtoBus, events: queue.Queue, deadline: float, run: TaskRun) -> None:
    by_ts: dict[int, dict] = {}
    ours = False  # a state of our task has been seen: partial messages before it may be stale
    answered: set[int] = set()
    while time.monotonic() < deadline:
        try:
            name, item = events.get(timeout=min(0.5, max(0.01, deadline - time.monotonic())))
        except queue.Empty:
            continue
        if name == "state":
            state = json.loads(item.state_json)
            if (state.get("currentTaskItem") or {}).get("id") != run.task_id:
                continue
            ours = True
            by_ts = {m["ts"]: m for m in state.get("clineMessages") or []}
        elif name == "partial" and ours:
            message = message_from_proto(bus, item)
            by_ts[message["ts"]] = message
        else:
            continue
        if run.first_message_s is None and by_ts:
            run.first_message_s = round(time.monotonic() - run.started_at, 3)
        run.messages = [by_ts[ts] for ts in sorted(by_ts)]
        last = run.messages[-1] if run.messages else None
        end = task_end(last)
        if end is not None:
            run.outcome, run.detail = end
            return
        if last and last.get("ask") in APPROVAL_ASKS and not last.get("partial") and last["ts"] not in answered:
            answered.add(last["ts"])
            run.approvals += 1
            bus.call("cline.TaskService", "askResponse", response_type="yesButtonClicked")


def _pump(name: str, stream: Any, events: queue.Queue) -> None:
    try:
        for item in stream:
            events.put((name, item))
    except grpc.RpcError:
        pass  # cancelled at the end, or the core went away: the deadline still holds
