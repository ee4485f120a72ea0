"""The examples/ scripts as modules, for tests that use their models."""
import importlib.util
import os
import sys

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def example(name: str):
    """An examples/ script as a module (its classes; its main does not run)."""
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)  # their own helpers (_check)
    spec = importlib.util.spec_from_file_location(f"example_{name}", os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
