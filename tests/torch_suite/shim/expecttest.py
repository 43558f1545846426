"""A stand-in for PyPI's expecttest, which Debian does not package and
torch.testing._internal.common_utils imports: its TestCase is unittest's
(the RPC suites never use expecttest's inline expectations, which fail
here saying so). On sys.path only where the real one is missing."""
import unittest

ACCEPT = False  # expecttest.ACCEPT: never rewrite expectations


class TestCase(unittest.TestCase):
    def assertExpectedInline(self, actual, expect, skip=0):
        raise NotImplementedError("assertExpectedInline needs PyPI's expecttest, not installed")
