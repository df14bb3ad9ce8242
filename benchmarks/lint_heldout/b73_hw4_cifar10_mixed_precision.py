"""
Homework 4, Problem 2 -- Mixed precision training on CIFAR-10 (solution)

    (a) fp32 baseline
    (b) torch.autocast only
    (c) "pure" fp16: cast the network and the inputs to half precision
    (d) torch.autocast + GradScaler
    (e) bonus: bfloat16 autocast
    (f) bonus: autocast + GradScaler with gradient accumulation

Run:  python hw4_p2.py --epochs 10 --part all
Prints a table with test accuracy and wall-clock time per variant and writes it to
results_p2.json (the numbers in the write-up come from a T4 on Colab).
"""
import argparse
import copy
import json
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torchvision
import torchvision.transforms as transforms

parser = argparse.ArgumentParser(description="HW4 P2: mixed precision")
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--batch-size", type=int, default=128)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--part", default="all", choices=["a", "b", "c", "d", "e", "f", "all"])
parser.add_argument("--data", default="./data")
args = parser.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)

# ---------------------------------------------------------------------------
# data (same as Problem 1)
# ---------------------------------------------------------------------------
mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
transform_train = transforms.Compose([
    transforms.RandomCrop(32, padding=4),
    transforms.RandomHorizontalFlip(),
    transforms.ToTensor(),
    transforms.Normalize(mean, std),
])
transform_test = transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])

trainset = torchvision.datasets.CIFAR10(root=args.data, train=True, download=True, transform=transform_train)
trainloader = torch.utils.data.DataLoader(trainset, batch_size=args.batch_size, shuffle=True, num_workers=2)
testset = torchvision.datasets.CIFAR10(root=args.data, train=False, download=True, transform=transform_test)
testloader = torch.utils.data.DataLoader(testset, batch_size=256, shuffle=False, num_workers=2)

classes = ("plane", "car", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


# ---------------------------------------------------------------------------
# model: the small ResNet from Problem 1
# ---------------------------------------------------------------------------
class BasicBlock(nn.Module):
    def __init__(self, in_planes, planes, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False),
                nn.BatchNorm2d(planes),
            )

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class Net(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU())
        self.layer1 = BasicBlock(32, 64, stride=1)
        self.layer2 = BasicBlock(64, 128, stride=2)
        self.layer3 = BasicBlock(128, 256, stride=2)
        self.fc = nn.Linear(256, num_classes)

    def forward(self, x):
        x = self.stem(x)
        x = self.layer3(self.layer2(self.layer1(x)))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x)


def evaluate(net, loader, half=False):
    net.eval()
    correct, total = 0, 0
    with torch.no_grad():
        for images, labels in loader:
            images, labels = images.to(device), labels.to(device)
            if half:
                images = images.half()
            outputs = net(images)
            _, predicted = outputs.max(1)
            total += labels.size(0)
            correct += predicted.eq(labels).sum().item()
    return 100.0 * correct / total


def log_epoch(tag, epoch, running_loss, n_batches, extra=""):
    print(f"[{tag}] epoch {epoch + 1}/{args.epochs}  loss {running_loss / n_batches:.4f} {extra}")


# ---------------------------------------------------------------------------
# (a) fp32 baseline
# ---------------------------------------------------------------------------
def train_fp32(net, epochs):
    criterion = nn.CrossEntropyLoss()
    optimizer = optim.Adam(net.parameters(), lr=args.lr)
    for epoch in range(epochs):
        net.train()
        running_loss = 0.0
        for inputs, labels in trainloader:
            inputs, labels = inputs.to(device), labels.to(device)
            optimizer.zero_grad()
            outputs = net(inputs)
            loss = criterion(outputs, labels)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
        log_epoch("fp32", epoch, running_loss, len(trainloader))
    return net


# ---------------------------------------------------------------------------
# (b) autocast only
# ---------------------------------------------------------------------------
def train_autocast(net, epochs):
    criterion = nn.CrossEntropyLoss()
    optimizer = optim.Adam(net.parameters(), lr=args.lr)
    for epoch in range(epochs):
        net.train()
        running_loss = 0.0
        for inputs, labels in trainloader:
            inputs, labels = inputs.to(device), labels.to(device)
            optimizer.zero_grad()
            with torch.autocast(device_type="cuda", dtype=torch.float16):  # expect: AMP010
                outputs = net(inputs)
                loss = criterion(outputs, labels)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
        log_epoch("autocast", epoch, running_loss, len(trainloader))
    return net


# ---------------------------------------------------------------------------
# (c) pure fp16 -- everything in half precision, no master weights
# ---------------------------------------------------------------------------
def train_half(epochs):
    net = Net().to(device).half()  # expect: AMP001
    criterion = nn.CrossEntropyLoss()
    optimizer = optim.Adam(net.parameters(), lr=args.lr)  # expect: AMP011
    for epoch in range(epochs):
        net.train()
        running_loss, n_nan = 0.0, 0
        for inputs, labels in trainloader:
            inputs = inputs.to(device).half()  # expect: AMP001
            labels = labels.to(device)
            optimizer.zero_grad()
            outputs = net(inputs)
            loss = criterion(outputs, labels)
            if not torch.isfinite(loss):
                n_nan += 1
                continue
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
        log_epoch("fp16", epoch, running_loss, len(trainloader), extra=f"non-finite batches: {n_nan}")
    return net


# ---------------------------------------------------------------------------
# (d) autocast + GradScaler (the recommended recipe)
# ---------------------------------------------------------------------------
def train_amp(net, epochs):
    criterion = nn.CrossEntropyLoss()
    optimizer = optim.Adam(net.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler("cuda")
    scales = []
    for epoch in range(epochs):
        net.train()
        running_loss = 0.0
        for inputs, labels in trainloader:
            inputs, labels = inputs.to(device), labels.to(device)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device_type="cuda", dtype=torch.float16):
                outputs = net(inputs)
                loss = criterion(outputs, labels)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            running_loss += loss.item()
        scales.append(scaler.get_scale())
        log_epoch("amp", epoch, running_loss, len(trainloader), extra=f"scale {scales[-1]:.0f}")
    return net, scales


# ---------------------------------------------------------------------------
# (e) bonus: bf16 autocast. Same exponent range as fp32, so no scaler.
# ---------------------------------------------------------------------------
def train_bf16(net, epochs):
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    optimizer = optim.Adam(net.parameters(), lr=args.lr)
    for epoch in range(epochs):
        net.train()
        running_loss = 0.0
        for inputs, labels in trainloader:
            inputs, labels = inputs.to(device), labels.to(device)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                outputs = net(inputs)
                loss = criterion(outputs, labels)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
        log_epoch("bf16", epoch, running_loss, len(trainloader))
    return net


# ---------------------------------------------------------------------------
# (f) AMP + gradient accumulation (effective batch = accum * batch_size)
# ---------------------------------------------------------------------------
def train_amp_accum(net, epochs, accum=4):
    criterion = nn.CrossEntropyLoss()
    optimizer = optim.Adam(net.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler("cuda")
    for epoch in range(epochs):
        net.train()
        running_loss = 0.0
        optimizer.zero_grad(set_to_none=True)
        for i, (inputs, labels) in enumerate(trainloader):
            inputs, labels = inputs.to(device), labels.to(device)
            with torch.autocast(device_type="cuda", dtype=torch.float16):
                outputs = net(inputs)
                loss = criterion(outputs, labels) / accum
                scaler.scale(loss).backward()  # expect: AMP008
            if (i + 1) % accum == 0 or (i + 1) == len(trainloader):
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
            running_loss += loss.item() * accum
        log_epoch("amp+accum", epoch, running_loss, len(trainloader))
    return net


def timed(fn, *a):
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.time()
    out = fn(*a)
    if device == "cuda":
        torch.cuda.synchronize()
    return out, time.time() - t0


# ---------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------
results = {}
run = (lambda p: args.part in (p, "all"))

if run("a"):
    net, secs = timed(train_fp32, Net().to(device), args.epochs)
    results["fp32"] = {"acc": evaluate(net, testloader), "time_s": secs}

if run("b"):
    net, secs = timed(train_autocast, Net().to(device), args.epochs)
    results["autocast"] = {"acc": evaluate(net, testloader), "time_s": secs}

if run("c"):
    net, secs = timed(train_half, args.epochs)
    results["pure_fp16"] = {"acc": evaluate(net, testloader, half=True), "time_s": secs}

if run("d"):
    (net, scales), secs = timed(train_amp, Net().to(device), args.epochs)
    results["amp"] = {"acc": evaluate(net, testloader), "time_s": secs, "final_scale": scales[-1]}
    # fp16 copy of the weights for the size comparison in question 2.4
    torch.save(copy.deepcopy(net).half().state_dict(), "p2_amp_fp16_weights.pt")
    torch.save(net.state_dict(), "p2_amp_fp32_weights.pt")

if run("e"):
    net, secs = timed(train_bf16, Net().to(device), args.epochs)
    results["bf16"] = {"acc": evaluate(net, testloader), "time_s": secs}

if run("f"):
    net, secs = timed(train_amp_accum, Net().to(device), args.epochs)
    results["amp_accum4"] = {"acc": evaluate(net, testloader), "time_s": secs}

print(f"{'variant':<12}{'acc (%)':>10}{'time (s)':>12}")
for name, r in results.items():
    print(f"{name:<12}{r['acc']:>10.2f}{r['time_s']:>12.1f}")
with open("results_p2.json", "w") as f:
    json.dump(results, f, indent=2)
