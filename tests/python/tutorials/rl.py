"""An RL agent and observers as in PyTorch's RPC tutorial ("Getting Started
with Distributed RPC Framework", REINFORCE): the Agent (rank 0) makes
RRef(self) in __init__ and an Observer per other rank with remote(); the
observers run each episode at once, getting actions from the agent and
reporting rewards through its RRef; the agent records them and trains. A
tiny deterministic walk stands in for gym's CartPole; each observer samples
from a generator of its own (their calls interleave). Rank 0 prints each
episode's rewards and loss, then "RESULT {json}".

    shmrun -n 3 -- python3 rl.py shmrpc
    RANK=r WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python3 rl.py torch
"""
import json
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import optim
from torch.distributions import Categorical

if (sys.argv[1:] or [os.environ.get("TUT_RPC", "torch")])[0] == "shmrpc":
    import shmrpc as rpc
    RANK, WORLD = int(os.environ["SHMRPC_RANK"]), int(os.environ["SHMRPC_WORLD_SIZE"])
else:
    import torch.distributed.rpc as rpc
    RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
RRef, rpc_async, remote = rpc.RRef, rpc.rpc_async, rpc.remote

AGENT_NAME, OBSERVER_NAME = "agent", "obs{}"
GAMMA, EPISODES, STEPS = 0.9, 5, 12


def _call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


def _remote_method(method, rref, *args, **kwargs):
    args = [method, rref] + list(args)
    return rpc.rpc_sync(rref.owner(), _call_method, args=args, kwargs=kwargs)


class Policy(nn.Module):
    def __init__(self):
        super(Policy, self).__init__()
        self.affine1 = nn.Linear(4, 16)
        self.affine2 = nn.Linear(16, 2)

    def forward(self, x):
        return F.softmax(self.affine2(F.relu(self.affine1(x))), dim=1)


class Env:
    """A walk: action 1 steps right, 0 left; reward 1 for a step toward 0;
    the episode ends beyond +-3."""

    def __init__(self, start):
        self.start = start

    def reset(self):
        self.pos, self.t = self.start, 0
        return [self.pos / 3.0, float(self.pos > 0), float(self.pos < 0), 0.0]

    def step(self, action):
        reward = float((action == 1) == (self.pos < 0))
        self.pos, self.t = self.pos + (1 if action == 1 else -1), self.t + 1
        state = [self.pos / 3.0, float(self.pos > 0), float(self.pos < 0), self.t / 10.0]
        return state, reward, abs(self.pos) > 3, {}


class Observer:
    def __init__(self):
        self.id = rpc.get_worker_info().id
        self.env = Env(start=[1, -2, 2][self.id % 3])

    def run_episode(self, agent_rref, n_steps):
        state, ep_reward = self.env.reset(), 0
        for step in range(n_steps):
            action = _remote_method(Agent.select_action, agent_rref, self.id, state)
            state, reward, done, _ = self.env.step(action)
            agent_rref.rpc_sync().report_reward(self.id, reward)
            ep_reward += reward
            if done:
                break
        return ep_reward


class Agent:
    def __init__(self, world_size):
        self.ob_rrefs = []
        self.agent_rref = RRef(self)
        self.rewards, self.saved_log_probs, self.generators = {}, {}, {}
        torch.manual_seed(0)
        self.policy = Policy()
        self.optimizer = optim.Adam(self.policy.parameters(), lr=5e-2)
        self.eps = 1e-7
        self.running_reward = 0
        for ob_rank in range(1, world_size):
            ob_info = rpc.get_worker_info(OBSERVER_NAME.format(ob_rank))
            self.ob_rrefs.append(remote(ob_info, Observer))
            self.rewards[ob_info.id], self.saved_log_probs[ob_info.id] = [], []
            self.generators[ob_info.id] = torch.Generator().manual_seed(ob_info.id)

    def select_action(self, ob_id, state):
        state = torch.tensor(state).float().unsqueeze(0)
        probs = self.policy(state)
        m = Categorical(probs)
        action = torch.multinomial(probs, 1, generator=self.generators[ob_id])[0]
        self.saved_log_probs[ob_id].append(m.log_prob(action))
        return action.item()

    def report_reward(self, ob_id, reward):
        self.rewards[ob_id].append(reward)

    def run_episode(self, n_steps=0):
        futs = [rpc_async(ob_rref.owner(), _call_method,
                          args=(Observer.run_episode, ob_rref, self.agent_rref, n_steps))
                for ob_rref in self.ob_rrefs]
        return [fut.wait() for fut in futs]  # the observers' own sums of rewards

    def finish_episode(self):
        R, probs, rewards = 0, [], []
        for ob_id in self.rewards:
            probs.extend(self.saved_log_probs[ob_id])
            rewards.extend(self.rewards[ob_id])
        recorded = [sum(self.rewards[ob_id]) for ob_id in self.rewards]
        self.running_reward = 0.05 * min(recorded) + (1 - 0.05) * self.running_reward
        for ob_id in self.rewards:
            self.rewards[ob_id], self.saved_log_probs[ob_id] = [], []
        policy_loss, returns = [], []
        for r in rewards[::-1]:
            R = r + GAMMA * R
            returns.insert(0, R)
        returns = torch.tensor(returns)
        returns = (returns - returns.mean()) / (returns.std() + self.eps)
        for log_prob, R in zip(probs, returns):
            policy_loss.append(-log_prob * R)
        self.optimizer.zero_grad()
        policy_loss = torch.cat(policy_loss).sum()
        policy_loss.backward()
        self.optimizer.step()
        return recorded, policy_loss.item()


def run_agent():
    agent = Agent(WORLD)
    before = [p.detach().clone() for p in agent.policy.parameters()]
    result = {"observed": [], "recorded": [], "losses": [], "running_reward": []}
    for episode in range(EPISODES):
        observed = agent.run_episode(n_steps=STEPS)
        recorded, loss = agent.finish_episode()
        print(f"episode {episode} rewards observed {observed} recorded on the agent {recorded} "
              f"loss {loss:.6f} running reward {agent.running_reward:.6f}")
        for key, value in zip(result, (observed, recorded, loss, agent.running_reward)):
            result[key].append(value)
    result["same_object"] = agent.agent_rref.local_value() is agent
    result["param_change"] = max((p.detach() - b).abs().max().item()
                                 for p, b in zip(agent.policy.parameters(), before))
    print("RESULT", json.dumps(result), flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if RANK == 0:
        rpc.init_rpc(AGENT_NAME, rank=RANK, world_size=WORLD)
        run_agent()
    else:
        rpc.init_rpc(OBSERVER_NAME.format(RANK), rank=RANK, world_size=WORLD)
    rpc.shutdown()
