"""What the sandbox tests run in the worker: kept apart from the test module, whose imports (torch)
would not fit under the worker's memory cap."""

import os


def behave(what: str, arg: int = 0):
    if what == "hang":
        while True:
            pass
    if what == "hog":
        return len(bytearray(arg * 2**20))
    if what == "exit":
        os._exit(1)
    return arg
