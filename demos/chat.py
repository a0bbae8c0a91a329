"""The Gradio app `surgeon chat` launches: a multimodal chat streaming from the engine, with the
model card beside it, and the recipe studio in a second tab.

    demo = build_demo("out/smollm2-eyes")     # None: the vision recipe's export, else the base model
    demo.launch()                             # or launch(None, port=7860)
"""

from __future__ import annotations

import gradio as gr
from PIL import Image

from surgeon.engine import SamplingParams

from .chat_messages import NotAnImage, engine_chat
from .model_card import read_card
from .model_choice import choose_model
from .session import ChatSession
from .studio import build_studio


def build_demo(model: str | None = None, *, engine_options: dict | None = None) -> gr.Blocks:
    """`model`: an export folder, a Hugging Face folder or an alias; None picks the default and says
    why. `engine_options`: keyword arguments for surgeon.engine.LLM (kv_cache_tokens, quantize, ...)."""
    session = ChatSession(choose_model(model), engine_options)

    async def respond(message, history, temperature, top_p, top_k, max_tokens, speculate=True):
        try:
            messages, images = engine_chat(message, history, session.is_vlm)
        except NotAnImage as exc:
            raise gr.Error(str(exc)) from None
        params = SamplingParams(
            temperature=temperature, top_p=top_p, top_k=int(top_k), max_tokens=int(max_tokens), speculate=speculate
        )
        reply = ""
        try:
            async for piece in session.stream(messages, images, params):
                reply += piece
                yield reply
        except ValueError as exc:  # the engine's word on a request it refuses (too long, images to a text model)
            raise gr.Error(str(exc)) from None

    def shown_model():
        card = read_card(session.choice.path)
        eyes = "reads images" if session.is_vlm else "text only"
        line = f"**Model: {session.name}** ({eyes}) — {session.choice.why}."
        plots = [(Image.open(png), caption) for png, caption in card.plots]
        return line, card.markdown, card.all_metrics or "No KL measurements in this card.", plots

    with gr.Blocks(title="model-surgeon") as demo:
        with gr.Tabs() as tabs:
            with gr.Tab("Chat", id="chat"):
                with gr.Row():
                    with gr.Column(scale=3):
                        model_line = gr.Markdown(elem_id="model-choice")
                        gr.ChatInterface(
                            respond,
                            multimodal=True,
                            api_name="chat",
                            fill_height=False,
                            chatbot=gr.Chatbot(elem_id="chatbot", height=480, label="Chat"),
                            textbox=gr.MultimodalTextbox(
                                elem_id="chat-input",
                                file_types=["image"],
                                placeholder="Ask something; attach an image with the clip",
                            ),
                            additional_inputs=[
                                gr.Slider(
                                    0,
                                    2,
                                    0.7,
                                    step=0.05,
                                    label="temperature (0: greedy)",
                                    elem_id="temperature",
                                    render=False,
                                ),
                                gr.Slider(0.05, 1, 0.9, step=0.05, label="top-p", elem_id="top-p", render=False),
                                gr.Slider(0, 200, 0, step=1, label="top-k (0: off)", elem_id="top-k", render=False),
                                gr.Slider(
                                    1, 1024, 256, step=1, label="max new tokens", elem_id="max-tokens", render=False
                                ),
                                gr.Checkbox(
                                    session.speculative,
                                    label=f"speculative decoding ({session.speculation_label}): same replies, faster",
                                    interactive=session.speculative,
                                    elem_id="speculate",
                                    render=False,
                                ),
                            ],
                            additional_inputs_accordion=gr.Accordion(
                                "Sampling", open=False, elem_id="sampling", render=False
                            ),
                        )
                    with gr.Column(scale=2, elem_id="model-card"):
                        card_text = gr.Markdown(elem_id="model-card-text")
                        with gr.Accordion("All metrics", open=False, elem_id="all-metrics"):
                            all_metrics = gr.Markdown(elem_id="all-metrics-text")
                        plots = gr.Gallery(label="Plots", columns=1, height="auto", elem_id="model-card-plots")
            with gr.Tab("Recipe studio", id="studio"):
                build_studio(session, shown_model, tabs=tabs, shown=[model_line, card_text, all_metrics, plots])
        demo.load(shown_model, outputs=[model_line, card_text, all_metrics, plots])
    demo.session = session  # so a caller (a test, the CLI) can close the engine thread
    return demo


def launch(
    model: str | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 7860,
    engine_options: dict | None = None,
    **launch_options,
) -> gr.Blocks:
    demo = build_demo(model, engine_options=engine_options)
    demo.launch(server_name=host, server_port=port, **launch_options)
    return demo
