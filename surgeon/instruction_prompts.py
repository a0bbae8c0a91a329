"""Instructions composed from topics, tasks and answer-format constraints, so a heal sees the breadth
of requests a chat model meets (explain, list, compare, write a poem or an email, ...) and the ways
people shape an answer (a word limit, bullet points, lower case, a closing phrase, ...), not only
questions about one book.

Written for model-surgeon. The constraints are kinds of request any chat user makes; the prompts
themselves are ours, and tests/test_prompt_sets.py checks that none equals a prompt of IFEval, the
chat evaluation set or the instruction check. Topics that the chat evaluation set asks about are
left out, so chat_kl stays a measure on unseen subjects.
"""

from __future__ import annotations

import random

from pydantic import BaseModel, ConfigDict, Field

from .errors import DataError

TOPICS: tuple[str, ...] = (
    "the water cycle",
    "honeybees",
    "the moon's phases",
    "recycling plastic",
    "the first airplanes",
    "volunteering",
    "learning a second language",
    "a vegetable garden",
    "the Roman Empire",
    "electric cars",
    "glaciers",
    "saving money",
    "the human heart",
    "chess",
    "owls",
    "public parks",
    "the printing press",
    "thunderstorms",
    "dolphins",
    "composting",
    "the Olympic Games",
    "solar panels",
    "a morning routine",
    "bread making",
    "coral reefs",
    "the internet",
    "time zones",
    "earthquakes",
    "penguins",
    "camping",
    "a city bus network",
    "vaccines",
    "the piano",
    "maps",
    "rainforests",
    "friendship between neighbours",
    "fire safety at home",
    "a farmers' market",
    "the planet Mars",
    "spiders",
    "the Great Wall of China",
    "tea",
    "a school science fair",
    "wind turbines",
    "sleep",
    "dinosaurs",
    "rivers",
    "bicycles in cities",
    "the alphabet",
    "chocolate",
    "teamwork",
    "snow",
    "elephants",
    "clocks",
    "the stock market",
    "a first day at a new school",
    "photography",
    "bees and flowers",
    "the ocean floor",
    "robots",
    "fossils",
    "gratitude",
    "a rainy weekend",
    "the Moon landing",
    "public libraries' history",
    "caterpillars and butterflies",
    "typing on a keyboard",
    "a road trip",
    "healthy breakfasts",
    "the Amazon river",
    "magnets",
    "the Eiffel Tower",
    "knitting",
    "credit cards",
    "the immune system",
    "mountain goats",
    "lightning",
    "a board game night",
    "the solar system",
    "pizza",
    "trees in winter",
    "whales",
    "archaeology",
    "paper money",
    "kindness to strangers",
    "cooking rice",
    "satellites",
    "a lost dog",
    "the violin",
    "frogs",
    "the Renaissance",
    "good posture",
    "sandcastles",
    "the wheel",
    "bird migration",
    "an old castle",
    "batteries",
    "jazz music",
    "polar bears",
    "gardening tools",
    "the Sahara's oases",
    "ice cream",
    "handwriting",
    "a thunderstorm at sea",
    "the telephone",
    "bamboo",
    "orchestras",
    "tidying a bedroom",
    "honey",
    "mushrooms",
    "the North Star",
    "cheese",
    "a marathon",
    "sharks",
    "moving to a new city",
    "the pyramids of Egypt",
    "wool",
    "a picnic",
    "traffic lights",
    "the brain",
    "comets",
    "a surprise party",
    "coffee",
    "squirrels",
    "vaccinating pets",
    "the theatre",
    "footprints in sand",
    "a village market",
    "hot air balloons",
    "a family recipe",
)

# What is asked about a topic. {t} is the topic, {n} a small number.
TASKS: tuple[str, ...] = (
    "Explain {t} to a curious ten-year-old.",
    "Write a short poem about {t}.",
    "Give {n} interesting facts about {t}.",
    "Write a short story that involves {t}.",
    "Write a friendly email to a colleague about {t}.",
    "Describe {t} in a few sentences.",
    "What are the pros and cons of {t}?",
    "Write a short blog post introduction about {t}.",
    "Why do people find {t} interesting?",
    "Write a haiku about {t}.",
    "Give {n} tips for someone who wants to learn about {t}.",
    "Write a short speech for a school assembly about {t}.",
    "What are common misunderstandings about {t}?",
    "Write a riddle whose answer is {t}.",
    "Summarise what most people should know about {t}.",
    "Write a limerick about {t}.",
    "Write a product description for a children's book about {t}.",
    "Compare {t} with {u}.",
    "Write {n} quiz questions about {t}, with their answers.",
    "Write a diary entry by someone who has just discovered {t}.",
    "Plan a one-hour lesson about {t}.",
    "Write a short letter to a grandparent about {t}.",
    "Explain how the way people think about {t} has changed over time.",
    "Write a dialogue between two friends talking about {t}.",
    "What questions would a journalist ask an expert on {t}?",
    "Give a simple definition of {t}, then an example.",
    "Write an advertisement slogan and a short pitch for a museum exhibit on {t}.",
    "Write a motivational message that uses {t} as a metaphor.",
)

# How the answer should look. Half the prompts carry one; {n} is a small number, {w} a word.
CONSTRAINTS: tuple[str, ...] = (
    "Answer in exactly {n} bullet points.",
    "Keep your answer under {k} words.",
    "Write your whole answer in lowercase letters.",
    "Write your whole answer in capital letters.",
    "End your answer with the exact phrase 'Hope this helps!'",
    "Wrap your entire answer in double quotation marks.",
    "Use the word '{w}' at least twice.",
    "Do not use any commas in your answer.",
    "Give your answer a title wrapped in double angular brackets, such as <<My title>>.",
    "Write {n} paragraphs separated by the markdown divider ***.",
    "Start your answer with the word '{w}'.",
    "Finish with a postscript that starts with P.S.",
    "Highlight at least {n} phrases with markdown, like *this phrase*.",
    "Format your entire answer as JSON.",
    "Answer in at least {k} words.",
    "Do not mention the word '{w}'.",
    "Write it as a numbered list.",
    "Use exactly {n} sentences.",
    "Include a placeholder in square brackets, such as [name].",
    "Split your answer into {n} sections, each starting with 'Section X'.",
)

WORDS: tuple[str, ...] = (
    "bright",
    "simple",
    "together",
    "future",
    "curious",
    "careful",
    "remember",
    "journey",
    "quiet",
    "important",
    "wonderful",
    "balance",
    "history",
    "nature",
    "friendly",
)


class TopicPrompts(BaseModel):
    """`count` distinct instructions composed from surgeon's topics, tasks and answer-format
    constraints (`constrained`: the share that carry one), drawn with `seed`."""

    model_config = ConfigDict(extra="forbid")

    count: int = Field(gt=0, le=100_000)
    constrained: float = Field(0.5, ge=0.0, le=1.0)
    seed: int = 0


def topic_prompts(spec: TopicPrompts) -> list[str]:
    """`spec.count` distinct prompts, the same for the same spec."""
    rng = random.Random(spec.seed)
    seen: set[str] = set()
    prompts: list[str] = []
    misses = 0
    while len(prompts) < spec.count:
        if misses > 20 * spec.count:
            raise DataError(
                f"from_topics: only {len(prompts)} distinct prompts found for count {spec.count}; "
                "lower count or raise constrained"
            )
        topic, other = rng.sample(TOPICS, 2)
        prompt = rng.choice(TASKS).format(t=topic, u=other, n=rng.randint(2, 5))
        if rng.random() < spec.constrained:
            constraint = rng.choice(CONSTRAINTS).format(
                n=rng.randint(2, 5), k=rng.choice((40, 60, 80, 100, 150)), w=rng.choice(WORDS)
            )
            prompt = f"{prompt} {constraint}"
        if prompt in seen:
            misses += 1
            continue
        seen.add(prompt)
        prompts.append(prompt)
    return prompts
