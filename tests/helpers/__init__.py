"""What the test modules share: stand-ins, model builders, reference outputs, stacks and the
suite's own xdist schedule. A test module imports from here (or gets a conftest fixture), never
from another test module."""
