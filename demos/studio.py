"""The recipe studio tab: edit a recipe, see its plan (or its errors, with file:line) as you type,
run it with a progress bar and a live loss plot (and stop it), then open the export in the chat tab."""

from __future__ import annotations

import queue
import threading
from pathlib import Path

import gradio as gr
import pandas as pd

from surgeon.errors import SurgeonError

from .model_choice import VISION_RECIPE, ModelChoice

LOSS_COLUMNS = ["step", "loss", "loop"]


def plan_text(path: str, text: str) -> str:
    """The plan table, or every problem found, one `file:line: ...` per line."""
    from surgeon.recipe.plan import format_plan, plan_recipe
    from surgeon.recipe.schema import load_recipe

    try:
        return format_plan(plan_recipe(load_recipe(_recipe_path(path), text)))
    except SurgeonError as exc:
        return "\n".join(f"error: {line}" for line in str(exc).splitlines())


def read_recipe(path: str) -> str:
    try:
        return _recipe_path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise gr.Error(f"cannot read {path}: {exc}") from None


def save_recipe(path: str, text: str) -> str:
    target = _recipe_path(path)
    target.write_text(text, encoding="utf-8")
    return f"saved {target}"


def run_studio_recipe(
    path: str,
    text: str,
    overwrite: bool,
    progress=gr.Progress(),  # noqa: B008 - Gradio finds its tracker by this default
    stop: threading.Event | None = None,
):
    """Yields (status, loss table, open-button update, export path) as the run goes. Setting
    `stop` ends the run at its next check (after a training step, or between steps); so does
    closing this generator (the page went away), so no run outlives the one that watched it."""
    from surgeon.errors import RunCancelled
    from surgeon.recipe.run import run_recipe
    from surgeon.recipe.schema import load_recipe
    from surgeon.training.progress import cancellable, watch_training

    try:
        recipe = load_recipe(_recipe_path(path), text)
    except SurgeonError as exc:
        raise gr.Error(str(exc)) from None
    events: queue.Queue = queue.Queue()
    stop = stop or threading.Event()

    def work():  # the run on a thread of its own, so this generator can stream what it reports
        try:
            with watch_training(events.put), cancellable(stop):
                events.put(("done", run_recipe(recipe, overwrite=overwrite)))
        except RunCancelled as exc:
            events.put(("cancelled", exc))
        except Exception as exc:  # shown in the status box; the studio stays up
            events.put(("failed", exc))

    threading.Thread(target=work, name="studio-run", daemon=True).start()
    try:
        yield from _follow(recipe, events, progress)
    finally:
        stop.set()  # a no-op once the run ended; otherwise it stops at its next check


def _follow(recipe, events: queue.Queue, progress):
    points: list[dict] = []
    status = f"running {recipe.spec.name} ({len(recipe.steps)} steps)"
    progress(0, desc=status)
    yield status, _loss_table(points), gr.update(interactive=False), None
    while True:
        event = events.get()
        if isinstance(event, dict):
            if "loss" in event:
                points.append({"step": event["step"], "loss": event["loss"], "loop": event["desc"]})
            status = f"{event['desc']}: step {event['step']} of {event['steps']}"
            progress(event["step"] / event["steps"], desc=status)
            yield status, _loss_table(points), gr.update(), None
            continue
        kind, payload = event
        if kind == "cancelled":
            note = "nothing exported (a heal's checkpoint is kept: `surgeon run --resume` on the saved recipe)"
            yield f"stopped: {payload}; {note}", _loss_table(points), gr.update(interactive=False), None
            return
        if kind == "failed":
            yield f"failed: {payload}", _loss_table(points), gr.update(interactive=False), None
            return
        lines = [f"exported {payload.target}"]
        lines += [f"{step['op']}: {step['what']}" for step in payload.report["provenance"]]
        yield "\n".join(lines), _loss_table(points), gr.update(interactive=True), str(payload.target)
        return


def build_studio(session, shown_model, *, tabs: gr.Tabs, shown: list) -> None:
    """Render the studio inside the current Blocks. `shown_model()` gives the values of the chat
    tab's `shown` components, refreshed once a run's export is opened in the chat."""
    start = str(VISION_RECIPE) if VISION_RECIPE.is_file() else "recipe.yaml"
    with gr.Row():
        path = gr.Textbox(
            start, label="recipe file (relative paths in it are read from its folder)", elem_id="studio-path", scale=4
        )
        load = gr.Button("Load", elem_id="studio-load", scale=1)
        save = gr.Button("Save", elem_id="studio-save", scale=1)
    with gr.Row():
        with gr.Column(scale=3):
            editor = gr.Code(
                read_recipe(start) if Path(start).is_file() else "",
                language="yaml",
                label="recipe",
                interactive=True,
                elem_id="studio-editor",
            )
        with gr.Column(scale=2):
            plan = gr.Textbox(label="plan", lines=14, max_lines=40, elem_id="studio-plan")
            with gr.Row():
                overwrite = gr.Checkbox(label="overwrite an existing export", elem_id="studio-overwrite")
                run = gr.Button("Run", variant="primary", elem_id="studio-run")
                stop = gr.Button("Stop", variant="stop", elem_id="studio-stop")
            status = gr.Textbox(label="status", lines=4, elem_id="studio-status")
            loss = gr.LinePlot(
                _loss_table([]), x="step", y="loss", color="loop", label="training loss", elem_id="studio-loss"
            )
            open_chat = gr.Button("Open the result in the chat", interactive=False, elem_id="studio-open")
    target = gr.State(None)

    load.click(read_recipe, path, editor).then(plan_text, [path, editor], plan)
    save.click(save_recipe, [path, editor], status)
    editor.change(plan_text, [path, editor], plan, trigger_mode="always_last", show_progress="hidden")
    switch = StopSwitch()

    def run_recipe_here(path, text, overwrite, progress=gr.Progress()):  # noqa: B008 - as above
        yield from run_studio_recipe(path, text, overwrite, progress, stop=switch.arm())

    run.click(
        run_recipe_here,
        [path, editor, overwrite],
        [status, loss, open_chat, target],
        concurrency_limit=1,
        concurrency_id="studio-run",
    )
    stop.click(switch.pull, None, None)

    def open_in_chat(folder):
        open_export(session, folder)
        return gr.Tabs(selected="chat"), *shown_model()

    open_chat.click(open_in_chat, target, [tabs, *shown])
    # The first plan, once the page is up (load() of the Blocks would need the Blocks here).
    plan.value = plan_text(start, editor.value) if editor.value else ""


class StopSwitch:
    """The Stop button's switch for the studio's one run at a time (its click has concurrency 1)."""

    def __init__(self):
        self.event = threading.Event()

    def arm(self) -> threading.Event:
        self.event = threading.Event()  # a fresh switch per run: an old press does not stop the next
        return self.event

    def pull(self) -> None:
        self.event.set()


def open_export(session, folder: str | None) -> None:
    """Serve the studio's export in the chat tab from now on."""
    if not folder:
        raise gr.Error("run a recipe first")
    session.open(ModelChoice(folder, "the export the studio just made"))


def _recipe_path(path: str) -> Path:
    return Path(path.strip() or "recipe.yaml").expanduser()


def _loss_table(points: list[dict]) -> pd.DataFrame:
    return pd.DataFrame(points, columns=LOSS_COLUMNS)
