"""Gradio apps, installed as `surgeon.demos`: the multimodal chat with its model card and the recipe
studio (`surgeon chat [PATH]`)."""
