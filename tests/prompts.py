"""Prompts of different kinds used by the end-to-end tests and the benchmark."""

CODE_PROMPTS = (
    "Rewrite this Python function with type hints and a docstring, and return the whole function:\n\n"
    "def moving_average(values, window):\n"
    "    if window <= 0:\n"
    "        raise ValueError('window must be positive')\n"
    "    result = []\n"
    "    total = 0\n"
    "    for index, value in enumerate(values):\n"
    "        total += value\n"
    "        if index >= window:\n"
    "            total -= values[index - window]\n"
    "        if index >= window - 1:\n"
    "            result.append(total / window)\n"
    "    return result\n",
    "Rename the variable `data` to `records` everywhere in this code and return the whole code:\n\n"
    "def summarize(data):\n"
    "    count = len(data)\n"
    "    if count == 0:\n"
    "        return {}\n"
    "    names = [row['name'] for row in data]\n"
    "    ages = [row['age'] for row in data]\n"
    "    return {'count': count, 'names': names, 'mean_age': sum(ages) / count}\n",
    "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces.",
)

CHAT_PROMPTS = (
    "What are three good habits for staying healthy?",
    "Explain in two sentences why the sky is blue.",
)

REPETITIVE_PROMPTS = (
    "Repeat the following list exactly, one item per line: apple, banana, cherry, apple, banana, cherry, "
    "apple, banana, cherry.",
)
