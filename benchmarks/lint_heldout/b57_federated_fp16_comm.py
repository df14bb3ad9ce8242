"""Federated averaging with a parameter server.

Clients train locally in mixed precision; model deltas travel over TCP as fp16 to
halve the upload, and the server keeps fp32 global weights.  Within a site, data
parallel replicas all-reduce their gradients in fp16 (a DDP communication hook).
"""

import copy
import socket
import struct
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parameters_to_vector, vector_to_parameters

WIRE_DTYPE = torch.float16


class SmallResNet(nn.Module):
    def __init__(self, num_classes=10, width=64):
        super().__init__()

        def block(c_in, c_out, stride):
            return nn.Sequential(nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU())

        self.features = nn.Sequential(block(3, width, 1), block(width, 2 * width, 2), block(2 * width, 4 * width, 2),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(4 * width, num_classes)

    def forward(self, x):
        return self.head(self.features(x))


def send_msg(sock, payload):
    sock.sendall(struct.pack("!Q", len(payload)) + payload)


def recv_msg(sock):
    (n,) = struct.unpack("!Q", sock.recv(8, socket.MSG_WAITALL))
    buf = bytearray()
    while len(buf) < n:
        buf.extend(sock.recv(min(1 << 20, n - len(buf))))
    return bytes(buf)


def decode_update(payload, device):
    vec = torch.frombuffer(bytearray(payload), dtype=torch.float16)
    return vec.to(device).float()


def fp16_compress_hook(state, bucket):
    """DDP comm hook: all-reduce the gradient bucket in fp16, hand back fp32."""
    group = state if state is not None else dist.group.WORLD
    world_size = group.size()
    compressed = bucket.buffer().to(torch.float16).div_(world_size)
    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut):
        return fut.value()[0].to(torch.float32)

    return fut.then(decompress)


def allreduce_gradients_fp16(model, world_size):
    """Fallback without DDP: one flat fp16 all-reduce, copied back into the fp32 grads."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads]).to(WIRE_DTYPE)
    flat.div_(world_size)
    dist.all_reduce(flat)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g).float())
        offset += n


def to_device(batch, device):
    images, labels = batch
    return images.to(device, non_blocking=True).half(), labels.to(device, non_blocking=True)  # expect: AMP001


class Client:
    def __init__(self, cid, loader, device, server_addr, lr=0.05, accum=2, verify_wire=False):
        self.cid = cid
        self.loader = loader
        self.device = device
        self.accum = accum
        self.verify_wire = verify_wire
        self.model = SmallResNet().to(device).to(memory_format=torch.channels_last)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
        self.scaler = torch.amp.GradScaler("cuda")
        self.sock = socket.create_connection(server_addr)
        self.personal_head = None

    def load_global(self, state):
        self.model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})

    def upload(self, delta):
        wire = delta.to(WIRE_DTYPE)
        payload = wire.cpu().numpy().tobytes()
        send_msg(self.sock, struct.pack("!I", self.cid) + payload)

    def local_train(self, epochs, world_size=1):
        start = parameters_to_vector(self.model.parameters()).detach().clone()
        self.model.train()
        for _ in range(epochs):
            for step, batch in enumerate(self.loader):
                images, labels = to_device(batch, self.device)
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = F.cross_entropy(self.model(images), labels)
                self.scaler.scale(loss / self.accum).backward()
                if (step + 1) % self.accum == 0:
                    if world_size > 1:
                        allreduce_gradients_fp16(self.model, world_size)
                    self.optimizer.step()  # expect: AMP006
                    self.optimizer.zero_grad(set_to_none=True)
        delta = parameters_to_vector(self.model.parameters()).detach() - start
        if self.verify_wire:
            torch.testing.assert_close(delta.to(WIRE_DTYPE).float(), delta, rtol=1e-3, atol=1e-4)
        self.upload(delta)
        return len(self.loader.dataset)

    def personalize(self, epochs=1, lr=0.01):
        """FedPer: fine-tune a private copy of the classifier head on the local data."""
        head = copy.deepcopy(self.model.head).to(WIRE_DTYPE)  # expect: AMP001
        opt = torch.optim.SGD(head.parameters(), lr=lr, momentum=0.9)
        self.model.eval()
        for _ in range(epochs):
            for images, labels in self.loader:
                images, labels = images.to(self.device), labels.to(self.device)
                with torch.no_grad():
                    feats = self.model.features(images).half()
                loss = F.cross_entropy(head(feats).float(), labels)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        self.personal_head = head


class ParameterServer:
    def __init__(self, model, host="0.0.0.0", port=29600, server_lr=1.0, momentum=0.9):
        self.global_model = model
        self.server_lr = server_lr
        self.momentum = momentum
        self.velocity = torch.zeros_like(parameters_to_vector(model.parameters()))
        self.listener = socket.create_server((host, port))

    def broadcast_state(self):
        return {k: v.to(WIRE_DTYPE) if v.is_floating_point() else v for k, v in self.global_model.state_dict().items()}

    def aggregate(self, payloads, weights):
        with torch.no_grad():
            total = float(sum(weights))
            avg = torch.zeros_like(self.velocity)
            for payload, w in zip(payloads, weights):
                avg += decode_update(payload, avg.device) * (w / total)
            self.velocity.mul_(self.momentum).add_(avg)
            params = parameters_to_vector(self.global_model.parameters())
            vector_to_parameters(params + self.server_lr * self.velocity, self.global_model.parameters())

    def collect(self, n_clients):
        payloads = []
        for _ in range(n_clients):
            conn, _ = self.listener.accept()
            msg = recv_msg(conn)
            payloads.append(msg[4:])
            conn.close()
        return payloads


def evaluate(model, loader, device):
    model.eval()
    correct = total = 0
    with torch.inference_mode():
        model_half = copy.deepcopy(model).half()
        for images, labels in loader:
            with torch.cuda.amp.autocast():  # expect: AMP009
                logits = model_half(images.to(device).half())
            correct += (logits.argmax(1).cpu() == labels).sum().item()
            total += labels.numel()
    return correct / max(1, total)


def quantize_for_archive(state):
    """Store client snapshots as numpy fp16 to keep the audit log small."""
    return {k: v.detach().cpu().numpy().astype(np.float16) for k, v in state.items()}


def run_round(server, clients, local_epochs, device):
    state = server.broadcast_state()
    weights = []
    for client in clients:
        client.load_global(state)
        weights.append(client.local_train(local_epochs))
    payloads = server.collect(len(clients))
    server.aggregate(payloads, weights)


def main(n_rounds=200, local_epochs=1, device="cuda"):
    from fl_data import make_client_loaders, make_test_loader  # project-local data partitioning

    server = ParameterServer(SmallResNet().to(device))
    loaders = make_client_loaders(n_clients=8, alpha=0.5)
    clients = [Client(i, loader, device, ("127.0.0.1", 29600)) for i, loader in enumerate(loaders)]
    test_loader = make_test_loader()
    archive = []
    for r in range(n_rounds):
        t0 = time.time()
        run_round(server, clients, local_epochs, device)
        if r % 10 == 0:
            acc = evaluate(server.global_model, test_loader, device)
            archive.append(quantize_for_archive(server.global_model.state_dict()))
            print(f"round {r} acc {acc:.4f} ({time.time() - t0:.1f}s)")
            torch.save({"round": r, "model": {k: v.half() for k, v in server.global_model.state_dict().items()}},
                       f"fedavg_round{r}.pt")
    for client in clients:
        client.personalize()


if __name__ == "__main__":
    main()
