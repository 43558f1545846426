"""torch's own RPC test suites, run against shmrpc.

The suites are Debian python3-torch's, read from the installed package
(torch.testing._internal.distributed.rpc), never copied here. This module
makes torch's names resolve to shmrpc first (shmrpc.install_as_torch: the
suites do `import torch.distributed.rpc as rpc`), then builds the test
classes the way torch's own test files do (rpc_utils.generate_tests) with a
fixture that names shmrpc's backend: torch's MultiProcessTestCase spawns
the ranks of each test, which meet at the fixture's init_method (a
file:// rendezvous, or tcp:// with RPC_INIT_WITH_TCP=1) without shmrun.
Every spawned rank imports this module again, so it installs shmrpc too.

tests/torch_suite/run.py runs them (make torch-suite).
"""
import logging
import os
import sys

try:
    import expecttest  # noqa: F401 (torch's common_utils needs it; Debian lacks it)
except ImportError:
    sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "shim"))

import shmrpc  # noqa: E402

# torch's suites log each process start and temporary module at INFO.
logging.getLogger("torch").setLevel(logging.WARNING)

shmrpc.install_as_torch()

import torch  # noqa: E402
import torch.distributed.rpc as rpc  # noqa: E402  (shmrpc now)
from torch.testing._internal.distributed.rpc.dist_autograd_test import (  # noqa: E402
    DistAutogradTest)
from torch.testing._internal.distributed.rpc.dist_optimizer_test import (  # noqa: E402
    DistOptimizerTest)
from torch.testing._internal.distributed.rpc.examples.parameter_server_test import (  # noqa: E402
    ParameterServerTest)
from torch.testing._internal.distributed.rpc.examples.reinforcement_learning_rpc_test import (  # noqa: E402,E501
    ReinforcementLearningRpcTest)
from torch.testing._internal.distributed.rpc.rpc_agent_test_fixture import (  # noqa: E402
    RpcAgentTestFixture)
from torch.testing._internal.distributed.rpc.rpc_test import RpcTest  # noqa: E402
from torch.testing._internal.common_distributed import MultiProcessTestCase  # noqa: E402
from torch.testing._internal.distributed.rpc_utils import generate_tests  # noqa: E402

assert rpc is shmrpc, "install_as_torch ran before torch's suites imported rpc"

SUITES = [RpcTest, DistAutogradTest, DistOptimizerTest, ParameterServerTest,
          ReinforcementLearningRpcTest]


class ShmrpcAgentTestFixture(RpcAgentTestFixture):
    def setUp(self):
        # torch's SpawnHelper.setUp, forking the ranks instead of spawning
        # them: each spawned rank imports torch anew (seconds of CPU per
        # test on a small machine). The test runs the same either way.
        MultiProcessTestCase.setUp(self)
        self._start_processes(torch.multiprocessing.get_context("fork").Process)

    @property
    def rpc_backend(self):
        return rpc.backend_registry.BackendType["TENSORPIPE"]  # any name: shmrpc's backend

    @property
    def rpc_backend_options(self):
        return rpc.backend_registry.construct_rpc_backend_options(
            self.rpc_backend, init_method=self.init_method)

    def get_shutdown_error_regex(self):
        return ".*"

    def get_timeout_error_regex(self):
        # shmrpc's words for a call that ran out of time (worker/client.c).
        return "RPC ran for more than|was not ready within"


globals().update(generate_tests("Shmrpc", ShmrpcAgentTestFixture, SUITES, __name__))
