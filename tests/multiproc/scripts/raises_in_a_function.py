"""A script whose error comes from a function it calls: its traceback has two frames."""


def load(name):
    raise KeyError(name)


load("missing-column")
