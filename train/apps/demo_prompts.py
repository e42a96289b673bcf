"""Write `data/demo_prompts.jsonl`: the instruction prompts the demo self-distills on and benchmarks with.

Every prompt is composed here from templates and topic lists written for selfspec (nothing is taken from
MT-bench, Alpaca or any other data set), so the demo needs nothing outside the repository and no network. Output is
deterministic (fixed seed) and in the MT-bench / Spec-Bench question format that `scripts/bench.py` reads:
one JSON object per line with `question_id`, `category` and `turns` (a list holding one prompt).

    python scripts/make_demo_prompts.py            # rewrites data/demo_prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

PER_CATEGORY = 60
SEED = 20261122

# ---------------------------------------------------------------------------------------------- writing
WRITING_FORMS = [
    "a short blog post", "a persuasive op-ed of about 300 words", "a friendly newsletter intro",
    "a product description for an online shop", "a speech for a small-town ceremony", "a cover letter",
    "a haiku sequence of three poems", "a limerick", "a one-paragraph short story", "a formal complaint letter",
    "a thank-you note", "a press release", "a LinkedIn post", "a diary entry from the year 2090",
]
WRITING_TOPICS = [
    "a community garden opening on an old parking lot", "a bakery that only sells bread made with local grain",
    "learning to swim as an adult", "a library that lends tools instead of books", "the first snowfall in a city",
    "a volunteer beach clean-up", "a bicycle repair workshop for teenagers", "a night train across the mountains",
    "a new public swimming pool", "a school that starts an hour later", "repairing an old wooden boat",
    "a museum of everyday objects", "a neighbourhood that bans cars on Sundays", "a robot that waters houseplants",
    "a chess club for retirees", "switching to a four-day work week", "a lighthouse turned into a hostel",
    "a lost cat that came home after a month", "a farmers' market in winter", "a mobile dentist van",
]
WRITING_EDITS = [
    "Rewrite the following sentence so it is clear and concise: 'Due to the fact that the meeting that was "
    "scheduled for Monday has been moved, it is the case that we will need to find a new time.'",
    "Turn this bullet list into a flowing paragraph: - bought a used bike - fixed the brakes - rode to work for "
    "a month - saved money on bus fares.",
    "Rewrite this message in a warmer tone: 'Your report is late. Send it today.'",
    "Shorten this paragraph to one sentence: 'Our team spent the quarter rebuilding the onboarding flow. We ran "
    "twelve user interviews, shipped three prototypes, and cut the sign-up time in half.'",
    "Give three alternative titles for an article about people who grow vegetables on apartment balconies.",
    "Write a catchy slogan for a reusable water bottle made from recycled aluminium.",
    "Suggest five opening lines for a mystery novel set in a snowed-in mountain hotel.",
    "Write a two-sentence horror story about a smart fridge.",
    "Write an acrostic poem where the first letters spell RIVER.",
    "Draft an out-of-office email reply for someone hiking for two weeks without phone signal.",
]

# --------------------------------------------------------------------------------------------- roleplay
ROLES = [
    "a ship's captain in the 1800s", "a medieval blacksmith", "a tour guide in ancient Rome",
    "a patient yoga teacher", "a detective in 1920s Chicago", "a park ranger", "a pirate who has become a chef",
    "a wise old tree", "a barista who knows every customer", "a space station engineer",
    "a personal fitness coach", "a museum curator", "a grumpy but kind librarian", "a sports commentator",
    "a travel agent from the future", "a job interviewer at a software company", "a wizard's apprentice",
    "a nutritionist", "a stand-up comedian", "a lighthouse keeper",
]
ROLE_TASKS = [
    "Greet me and explain what you do on a normal day.",
    "I am nervous about my first day with you. Reassure me and tell me what to expect.",
    "Describe the most surprising thing that ever happened to you at work.",
    "Give me three pieces of advice for someone who wants to do your job.",
    "I just made a big mistake. Respond in character and help me fix it.",
    "Tell me about the tools you use every day and why each one matters.",
]

# -------------------------------------------------------------------------------------------- reasoning
REASONING = [
    "Anna is taller than Ben. Ben is taller than Chloe. Is Chloe taller than Anna? Explain your reasoning.",
    "A farmer has 12 sheep. All but 5 run away. How many sheep are left? Explain.",
    "If it takes 4 machines 4 minutes to make 4 widgets, how long do 8 machines take to make 8 widgets?",
    "Three friends split a bill. Each pays $10, then the waiter returns $5, and they keep $1 each and tip $2. "
    "Where did the missing dollar go? Explain the error in the question.",
    "Which is heavier: a kilogram of feathers or a kilogram of iron? Explain why people get this wrong.",
    "A clock shows 3:15. What is the angle between the hour and minute hands?",
    "Five runners finish a race. Dana beats Eli, Eli beats Fay, Gus finishes right after Dana, and Hal is last. "
    "What is the finishing order?",
    "If all bloops are razzies and some razzies are lazzies, must some bloops be lazzies? Explain.",
    "A bat and a ball cost $1.10 in total. The bat costs $1.00 more than the ball. How much is the ball?",
    "You have two ropes that each burn in exactly one hour, unevenly. How can you measure 45 minutes?",
    "In a room of 23 people, why is it likely that two share a birthday? Explain intuitively.",
    "A snail climbs 3 metres up a 10-metre wall each day and slides back 2 metres each night. On which day "
    "does it reach the top?",
    "Tom's mother has four children: North, East, South and who else? Explain.",
    "Is the statement 'This sentence is false' true or false? Discuss.",
    "There are three boxes labelled apples, oranges and mixed, and every label is wrong. You may take one "
    "fruit from one box. How do you relabel them correctly?",
    "A train leaves at 9:00 going 60 km/h; another leaves the same station at 10:00 going 90 km/h on the "
    "same track. When does the second catch up?",
    "Why can't you fold a sheet of paper in half more than about seven or eight times? Reason it out.",
    "If yesterday was the day before Friday, what day will it be the day after tomorrow?",
    "A shop raises a price by 20% and then lowers it by 20%. Is the final price the same as the original?",
    "Explain the Monty Hall problem and whether you should switch doors.",
]
REASONING_TEMPLATES = [
    "Mia is {a} years old. Her brother is {b} years older than half her age. How old is her brother? Show steps.",
    "A tank fills in {a} hours with one pipe and empties in {b} hours with another. If both run, how long "
    "until it is full? Explain.",
    "In a line of {c} people, Sam stands in position {a} counted from the front. What is his position "
    "counted from the back?",
    "A week has 7 days. If today is Wednesday, what day is it {a} days from now? Explain.",
]

# ------------------------------------------------------------------------------------------------- math
MATH_TEMPLATES = [
    "Solve for x: {a}x + {b} = {c}. Show your work.",
    "What is {a}% of {c}? Explain the steps.",
    "Compute {a} × {b} - {c} and explain the order of operations.",
    "A rectangle has sides {a} cm and {b} cm. What are its area and perimeter?",
    "Find the greatest common divisor of {c} and {d}.",
    "A car travels {c} km in {a} hours. What is its average speed?",
    "Simplify the fraction {d}/{c} and write it as a decimal.",
    "What is the sum of the integers from 1 to {c}?",
    "A circle has radius {a}. Find its circumference and area, using pi ≈ 3.14.",
    "Solve the system: x + y = {c}, x - y = {a}.",
    "If a shirt costs ${c} and is discounted by {a}%, what is the sale price?",
    "Find the derivative of f(x) = {a}x^3 - {b}x + {c}.",
    "What is the probability of rolling a total of {e} with two fair six-sided dice?",
    "Convert {c} minutes into hours and minutes.",
    "The mean of {a}, {b}, {c} and x is {d}. Find x.",
]
MATH_FIXED = [
    "Prove that the sum of two even numbers is even.",
    "Explain why the square root of 2 is irrational.",
    "What is a prime number? List the primes below 50.",
    "Explain the Pythagorean theorem with an example.",
    "How many ways can you arrange the letters of the word LEVEL?",
    "Integrate 2x·e^(x^2) with respect to x.",
    "Explain the difference between permutations and combinations with an example of each.",
    "What is the next number in the sequence 2, 6, 12, 20, 30, ...? Explain the pattern.",
]

# ----------------------------------------------------------------------------------------------- coding
CODE_LANGS = ["Python", "JavaScript", "Rust", "Go", "C", "Java", "TypeScript", "Bash"]
CODE_TASKS = [
    "reverses the words in a sentence", "checks whether a string is a palindrome, ignoring punctuation",
    "returns the n-th Fibonacci number iteratively", "counts how often each word appears in a text",
    "merges two sorted lists into one sorted list", "finds the second largest number in a list",
    "removes duplicate items from a list while keeping their order", "converts Celsius to Fahrenheit",
    "checks whether a number is prime", "flattens a nested list of integers",
    "implements binary search over a sorted array", "computes the factorial of n recursively",
    "validates that brackets in a string are balanced", "rotates a matrix by 90 degrees",
    "reads a CSV file and prints the average of one column", "finds the longest common prefix of a list of strings",
    "implements a simple stack with push, pop and peek", "groups a list of words into anagrams",
    "converts a Roman numeral to an integer", "computes the running median of a stream of numbers",
]
CODE_FIXED = [
    "Explain the difference between a list and a tuple in Python, with examples.",
    "What does the following Python code print, and why?\n\nx = [1, 2, 3]\ny = x\ny.append(4)\nprint(x)",
    "Find the bug in this function and fix it:\n\ndef average(xs):\n    total = 0\n    for x in xs:\n"
    "        total += x\n    return total / len(x)",
    "Explain what a race condition is and show a tiny example in any language.",
    "Write a SQL query that returns the five customers with the highest total order value from tables "
    "customers(id, name) and orders(id, customer_id, amount).",
    "Explain Big-O notation using three short code examples.",
    "Write a regular expression that matches a date in the form YYYY-MM-DD and explain each part.",
    "What is the difference between git merge and git rebase? When would you use each?",
    "Explain recursion to a beginner and give an example that is not factorial.",
    "Write a Python class for a bank account with deposit, withdraw and a balance that cannot go negative.",
]

# ------------------------------------------------------------------------------------------- extraction
PASSAGES = [
    "On 4 March, Lena Ortiz, head of operations at Brightwell Foods, announced that the company would open a "
    "new warehouse in Tampere, Finland, creating 140 jobs. The site will cost 12 million euros and should be "
    "running by October.",
    "Order #5521 — 3 × notebook (2.50 each), 1 × fountain pen (18.00), 2 × ink cartridge (4.25 each). "
    "Shipping: 5.00. Customer: Raj Patel, 17 Elm Row, Leeds.",
    "The meeting on Tuesday agreed three actions: Priya will draft the budget by Friday, Marco will book the "
    "venue for the June workshop, and Helen will email the speakers before the end of the month.",
    "Review: 'The battery lasts two full days and the screen is sharp, but the camera struggles in low light "
    "and the charger is not included. For the price, it is still a good deal.' — 4 stars",
    "Flight QX218 from Lisbon to Oslo departs at 07:45 from gate B12 and lands at 12:30 local time. Passengers "
    "may take one cabin bag up to 8 kg.",
    "Recipe: whisk 2 eggs with 150 ml milk, add 100 g flour and a pinch of salt, rest for 20 minutes, then cook "
    "thin pancakes in a hot buttered pan, about one minute per side.",
    "The survey of 1,200 commuters found that 46% travel by bus, 31% by car, 15% by bike and 8% on foot. "
    "Cyclists reported the highest satisfaction.",
    "Dr. Amara Nwosu joined Riverside Hospital in 2019 as a paediatric surgeon after ten years at St. Clare's. "
    "She speaks English, Igbo and French.",
    "Job ad: Junior data analyst, hybrid (3 days office), Rotterdam. Requirements: SQL, basic Python, good "
    "English. Salary 3,200-3,800 EUR per month. Apply by 30 June.",
    "Weather for Saturday: morning fog clearing by 10:00, highs of 18°C, a 30% chance of showers after 16:00, "
    "light winds from the south-west.",
]
EXTRACTION_TASKS = [
    "Extract every person's name and their role as a JSON list.",
    "List all numbers in the text and what each refers to.",
    "Summarise the text in one sentence.",
    "Turn the text into a table with clear column headings.",
    "Answer in JSON with keys 'who', 'what', 'when' and 'where' (use null if missing).",
    "Write three questions that can be answered from the text, followed by their answers.",
]

# ----------------------------------------------------------------------------------------------- stem
STEM_QUESTIONS = [
    "Why is the sky blue during the day and red at sunset?", "How do vaccines train the immune system?",
    "What causes the seasons on Earth?", "Explain how a refrigerator moves heat out of its inside.",
    "What is the difference between weather and climate?", "How does a lithium-ion battery store energy?",
    "Why do ice cubes float in water?", "Explain photosynthesis in simple terms.",
    "How does GPS work out where you are?", "What is DNA and how does it store information?",
    "Why does a metal spoon feel colder than a wooden one at the same temperature?",
    "What is entropy? Give an everyday example.", "How do noise-cancelling headphones work?",
    "Explain the difference between nuclear fission and fusion.", "What is a black hole?",
    "How do antibiotics work, and why do bacteria become resistant?", "What makes a material a superconductor?",
    "Why do we have tides?", "How does an electric motor turn electricity into motion?",
    "What is the greenhouse effect?", "Explain how a neural network learns from examples.",
    "What is the difference between speed and velocity?", "How does the heart pump blood around the body?",
    "Why does bread rise when it bakes?", "Explain what pH measures and give examples of acids and bases.",
    "How do solar panels turn sunlight into electricity?", "What is plate tectonics?",
    "How does a compiler differ from an interpreter?", "Why is the Moon always showing the same face to Earth?",
    "What is the speed of sound, and why does it change with temperature?",
]
STEM_TEMPLATES = [
    "Explain {x} to a ten-year-old.", "Explain {x} in three short paragraphs for a university student.",
]
STEM_TOPICS = ["how rainbows form", "how earthquakes are measured", "why the Earth has a magnetic field",
               "how a microwave oven heats food", "what an atom is made of", "how airplanes stay in the air",
               "how the human eye sees colour", "why stars twinkle", "how bees make honey", "how recycling plastic works",
               "how vaccines are tested", "why leaves change colour in autumn", "how a transistor works",
               "how sound travels through air", "what causes lightning", "how a hash table finds things quickly"]

# ----------------------------------------------------------------------------------------------- humanities
HUMANITIES_QUESTIONS = [
    "What were the main causes of the French Revolution?", "Why did the Roman Empire in the West decline?",
    "Explain the idea of supply and demand with an everyday example.", "What is the social contract in philosophy?",
    "How did the printing press change Europe?", "Compare utilitarianism and virtue ethics.",
    "What was the Silk Road and why did it matter?", "Why do countries trade with each other?",
    "What is inflation and why do central banks care about it?", "Describe the main features of Gothic architecture.",
    "How did the Industrial Revolution change family life?", "What is the role of a constitution?",
    "Why is Shakespeare still performed today?", "Explain the difference between a democracy and a republic.",
    "How did the invention of writing change human societies?", "What is stoicism and how might it help someone today?",
    "Why did the Cold War never turn into a direct war between the superpowers?",
    "What makes a piece of music 'classical'?", "Explain opportunity cost with two examples.",
    "How do languages change over time?", "What was the Renaissance and where did it begin?",
    "Why do some cities grow while others shrink?", "What is the tragedy of the commons?",
    "How did the Meiji Restoration change Japan?", "What is the purpose of a museum in modern society?",
]
HUMANITIES_TEMPLATES = [
    "Write a short essay on the role of {x} in shaping modern society.",
    "Give arguments for and against {x}.",
]
HUMANITIES_TOPICS = ["public libraries", "universal basic income", "compulsory voting", "the invention of the railway",
                     "social media in politics", "learning a second language at school", "tourism in historic cities",
                     "remote work", "free public transport", "the four-day school week", "national parks",
                     "the printing of paper money",
                     "public funding for the arts", "city-wide bans on advertising billboards",
                     "teaching philosophy in primary school", "preserving endangered languages",
                     "the spread of the printing press", "returning museum artefacts to their countries of origin"]


def _numbers(rng: random.Random) -> dict:
    a, b = rng.randint(2, 12), rng.randint(2, 15)
    return dict(a=a, b=b, c=rng.randint(20, 240), d=rng.randint(10, 96), e=rng.randint(2, 12))


def build_prompts(per_category: int = PER_CATEGORY, seed: int = SEED) -> list[dict]:
    rng = random.Random(seed)
    pools: dict[str, list[str]] = {
        "writing": [f"Write {f} about {t}." for f in WRITING_FORMS for t in WRITING_TOPICS] + WRITING_EDITS,
        "roleplay": [f"Pretend you are {r}. {t}" for r in ROLES for t in ROLE_TASKS],
        "reasoning": REASONING + [t.format(**_numbers(rng)) for t in REASONING_TEMPLATES for _ in range(15)],
        "math": [t.format(**_numbers(rng)) for t in MATH_TEMPLATES for _ in range(8)] + MATH_FIXED,
        "coding": [f"Write a {lang} function that {task}." for lang in CODE_LANGS for task in CODE_TASKS]
        + CODE_FIXED,
        "extraction": [f"{task}\n\nText: {p}" for p in PASSAGES for task in EXTRACTION_TASKS],
        "stem": STEM_QUESTIONS + [t.format(x=x) for t in STEM_TEMPLATES for x in STEM_TOPICS],
        "humanities": HUMANITIES_QUESTIONS + [t.format(x=x) for t in HUMANITIES_TEMPLATES for x in HUMANITIES_TOPICS],
    }
    rows = []
    for category, pool in pools.items():
        unique = sorted(set(pool))
        if len(unique) < per_category:
            raise ValueError(f"only {len(unique)} distinct {category} prompts for per_category={per_category}")
        picked = rng.sample(unique, min(per_category, len(unique)))
        rows += [{"category": category, "turns": [p]} for p in picked]
    rng.shuffle(rows)  # any prefix or suffix slice mixes every category
    return [{"question_id": i, **row} for i, row in enumerate(rows)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[2] / "data" / "demo_prompts.jsonl")
    parser.add_argument("--per-category", type=int, default=PER_CATEGORY)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    rows = build_prompts(args.per_category)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {len(rows)} prompts to {args.out}")
    return 0
