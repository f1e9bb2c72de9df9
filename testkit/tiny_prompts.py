"""Token-id prompts for the tiny random target's split-decoding tests: a repeat that prompt
lookup finds, a long repeated run, a single token and one with no pattern."""
PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7],
    list(range(20, 40)) * 2,
    [100],
    [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9],
]
MAX_NEW = 40
