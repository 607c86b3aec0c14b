"""The evaluation texts written for this project (data only; ``texts.py`` renders them).

Multi-topic conversations (several topic shifts, later turns that only make sense with the
current topic in view), the free-generation prompts and the continuation prompt.
"""

from __future__ import annotations

CONVERSATIONS: list[list[dict]] = [
    [
        {"role": "system", "content": "You are a helpful assistant who answers in detail."},
        {"role": "user", "content": "I want to start baking bread at home. What do I need?"},
        {
            "role": "assistant",
            "content": (
                "To bake a simple loaf you need flour, water, salt and yeast. Bread flour has more "
                "protein than all-purpose flour, which helps the dough build gluten and gives a "
                "chewier crumb. You also want a large bowl, a kitchen scale, a bench scraper and "
                "either a loaf pan or a heavy pot with a lid, such as a Dutch oven. The scale "
                "matters more than people expect: bakers measure by weight, because a cup of flour "
                "can vary by twenty percent depending on how it is scooped."
            ),
        },
        {"role": "user", "content": "How much water should I use for 500 grams of flour?"},
        {
            "role": "assistant",
            "content": (
                "For 500 grams of bread flour, start with 350 grams of water. That is a "
                "hydration of "
                "seventy percent, which is easy to handle for a beginner. Add 10 grams of salt and "
                "about 5 grams of instant yeast. Mix until no dry flour remains, rest the dough "
                "for "
                "half an hour, then fold it over itself a few times every thirty minutes for two "
                "hours. Wetter doughs give a more open crumb but are stickier to shape."
            ),
        },
        {
            "role": "user",
            "content": "Thanks. Switching topics: my bicycle chain keeps "
            "slipping when I pedal hard. Why?",
        },
        {
            "role": "assistant",
            "content": (
                "A chain that slips under load usually has one of three causes. First, the chain "
                "may be worn and stretched, so it no longer sits deep in the teeth of the "
                "cassette. "
                "A chain checker tool tells you this in seconds. Second, the cassette or "
                "chainrings "
                "may be worn, often because an old chain was ridden too long. Third, the rear "
                "derailleur may be out of adjustment, so the chain sits between two cogs. Try "
                "turning the barrel adjuster a quarter turn at a time while shifting through the "
                "gears."
            ),
        },
        {
            "role": "user",
            "content": "The chain checker says it is stretched past 0.75. What should I replace?",
        },
        {
            "role": "assistant",
            "content": (
                "Past 0.75 percent the chain should be replaced, and at that point it has often "
                "worn the cassette as well. Fit a new chain first and test it under load in every "
                "gear. If it still skips on the cogs you use most, replace the cassette too. "
                "Chainrings last longer, so they rarely need replacing at the same time."
            ),
        },
        {
            "role": "user",
            "content": "Back to the bread: my first loaf came out dense and "
            "flat. Given the recipe you gave me, what went wrong?",
        },
        {
            "role": "assistant",
            "content": (
                "With 350 grams of water and 5 grams of yeast, a dense flat loaf usually means the "
                "dough was under-proofed or the gluten was weak. If your kitchen is cool, two "
                "hours "
                "of bulk fermentation may not be enough; wait until the dough has grown by about "
                "half and looks domed and airy. Also make sure you used bread flour and did the "
                "folds, because they build the strength that holds the gas. Finally, shape the "
                "loaf tightly so the surface is taut before the final proof."
            ),
        },
        {
            "role": "user",
            "content": "And for the chain, how do I know the new one has the right length?",
        },
        {
            "role": "assistant",
            "content": (
                "Wrap the new chain around the largest chainring and the largest rear cog without "
                "threading it through the derailleur, pull it tight, and add one full link, which "
                "is two half links. Then thread it properly and check that the derailleur cage is "
                "not stretched flat in the biggest gear combination and that the chain does not "
                "sag in the smallest one."
            ),
        },
    ],
    [
        {"role": "system", "content": "You are a knowledgeable and patient tutor."},
        {"role": "user", "content": "Can you explain how vaccines train the immune system?"},
        {
            "role": "assistant",
            "content": (
                "A vaccine shows the immune system a harmless version or piece of a pathogen, such "
                "as an inactivated virus, a protein from its surface, or instructions for making "
                "that protein. Immune cells called B cells make antibodies that bind to it, and T "
                "cells learn to recognise infected cells. After the response fades, memory cells "
                "remain. If the real pathogen appears later, these memory cells respond within "
                "days instead of weeks, often before the person feels sick."
            ),
        },
        {"role": "user", "content": "Why do some vaccines need booster doses?"},
        {
            "role": "assistant",
            "content": (
                "Some vaccines produce a response that wanes over time, so antibody levels drop "
                "and memory is less sharp. A booster dose reminds the immune system and usually "
                "produces a stronger and longer lasting response than the first dose. Boosters are "
                "also used when a pathogen changes, as with influenza, so the vaccine is updated "
                "to "
                "match the strains that are circulating."
            ),
        },
        {
            "role": "user",
            "content": "Different question. I am planning a garden with "
            "tomatoes, basil and carrots in a small sunny yard. How should I lay it out?",
        },
        {
            "role": "assistant",
            "content": (
                "Put the tomatoes on the north side of the bed so they do not shade the shorter "
                "plants as they grow tall. Space them about sixty centimetres apart and give each "
                "a stake or cage. Basil grows well between or in front of the tomatoes and many "
                "gardeners like the pairing. Carrots need loose, stone-free soil and full sun, so "
                "sow them in rows at the front of the bed, and thin the seedlings to five "
                "centimetres apart once they come up."
            ),
        },
        {
            "role": "user",
            "content": "The carrot seeds have not come up after two weeks. What could be wrong?",
        },
        {
            "role": "assistant",
            "content": (
                "Carrot seed is slow and needs the surface to stay moist the whole time: it can "
                "take up to three weeks to germinate in cool soil. If the top crusted over or "
                "dried out in the sun, the seedlings may have died before emerging. Cover the row "
                "with a board or a damp cloth until the first shoots appear, water gently every "
                "day, and sow a fresh row if nothing shows in another week."
            ),
        },
        {
            "role": "user",
            "content": "Going back to vaccines: how is the booster for "
            "influenza decided each year?",
        },
        {
            "role": "assistant",
            "content": (
                "Influenza changes quickly, so each year surveillance laboratories around the "
                "world sequence the viruses that are circulating. Twice a year, experts review "
                "these data and recommend which strains the next season's vaccine should contain, "
                "one recommendation for each hemisphere. Manufacturers then need about six months "
                "to produce the doses, which is why the choice is a forecast and the match is "
                "sometimes imperfect."
            ),
        },
        {
            "role": "user",
            "content": "And the tomatoes have yellow leaves at the bottom. Should I worry?",
        },
        {
            "role": "assistant",
            "content": (
                "Yellowing of the lowest leaves is common on tomatoes and often harmless: the "
                "plant "
                "lets its oldest leaves go as it grows. It can also signal a lack of nitrogen or "
                "an early fungal disease such as early blight, which shows brown spots with rings. "
                "Remove the yellow leaves, water at the base rather than over the foliage, mulch "
                "the soil, and feed the plants if growth looks pale overall."
            ),
        },
    ],
    [
        {"role": "system", "content": "You are an assistant for a small software team."},
        {
            "role": "user",
            "content": "Our Python service gets slower every hour until we "
            "restart it. Where should we look?",
        },
        {
            "role": "assistant",
            "content": (
                "A service that slows down steadily and recovers on restart is usually growing "
                "something: memory, a cache without a size limit, a list of callbacks, open file "
                "handles or database connections. Start by graphing the process memory and the "
                "number of open connections over a few hours. If memory grows, take two heap "
                "snapshots with tracemalloc an hour apart and compare the allocation sites that "
                "grew the most."
            ),
        },
        {
            "role": "user",
            "content": "tracemalloc shows a dictionary in our session module "
            "growing without bound.",
        },
        {
            "role": "assistant",
            "content": (
                "Then the session module probably stores an entry per request or per user and "
                "never removes it. Give the dictionary a bound: an LRU cache with a maximum size, "
                "or entries with an expiry time that a periodic task sweeps. If the entries are "
                "meant to live as long as a user's session, delete them when the session ends and "
                "add a test that opens and closes many sessions and checks the size stays flat."
            ),
        },
        {
            "role": "user",
            "content": "Separate thing: we need to write a short onboarding "
            "guide for new engineers. What should it cover?",
        },
        {
            "role": "assistant",
            "content": (
                "A good onboarding guide covers how to get the code running locally in under an "
                "hour, how the system is laid out, who owns what, and how a change goes from a "
                "branch to production. Include the commands to run the tests, the conventions for "
                "commit messages and reviews, where the logs and dashboards live, and a first task "
                "that is small but touches the real deployment path."
            ),
        },
        {"role": "user", "content": "Should the guide mention the session leak we just found?"},
        {
            "role": "assistant",
            "content": (
                "Yes, briefly, as an example of how the team investigates production problems: "
                "what the symptom was, how tracemalloc located the growing dictionary, and which "
                "test now guards against it. New engineers learn the debugging tools faster from "
                "a real story than from a list, and it explains why the session module has a size "
                "limit that might otherwise look arbitrary."
            ),
        },
        {
            "role": "user",
            "content": "What size limit would you pick for that session "
            "cache if we have about two thousand active users?",
        },
        {
            "role": "assistant",
            "content": (
                "With about two thousand active users, a limit of five to ten thousand entries "
                "leaves room for peaks and for users with several devices, while keeping the "
                "memory bounded. Measure the size of one entry, multiply by the limit, and check "
                "that the total is a small fraction of the process memory. Add a metric for the "
                "number of evictions so you notice if the limit is too tight."
            ),
        },
    ],
]


GENERATION_PROMPTS = [
    "Write a long, detailed guide to planning a two-week trip through Japan: which cities to "
    "visit, how to travel between them, what to eat, what to pack, and how to budget. Cover "
    "each part in depth.",
    "Explain in detail, step by step, how a computer runs a program: from the source code "
    "through compilation, memory, the processor, the operating system, input and output. Give "
    "examples for each stage.",
    "Write a long story about a lighthouse keeper on a remote island who finds a mysterious "
    "message in a bottle, with several chapters, named characters, and a surprising ending.",
    "Describe in depth how bread is made at home: ingredients, kneading, rising, shaping, "
    "baking and common mistakes, with a full recipe and tips for each step.",
    "Write a detailed history of the bicycle, from the first wooden designs to modern racing "
    "and electric bikes, with the inventors, the key improvements and how people used them.",
    "Explain how the human immune system fights an infection, step by step: the first "
    "barriers, the innate response, antibodies, memory cells and vaccines, with examples.",
]

CONTINUATION_PROMPT = (
    "Write a long essay on the history of mathematics, from counting in ancient "
    "Mesopotamia to modern computers, with many examples and details."
)
