#!/usr/bin/env python
# coding: utf-8

# # CIFAR-10 in a few minutes
# Trying to get ResNet9 under 5 min on the workstation. Notes at the bottom.

# In[1]:


import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
import torchvision.transforms as T

device = torch.device("cuda")
torch.backends.cudnn.benchmark = True


# In[2]:


mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
train_tf = T.Compose([T.RandomCrop(32, padding=4, padding_mode="reflect"), T.RandomHorizontalFlip(),
                      T.ToTensor(), T.Normalize(mean, std)])
test_tf = T.Compose([T.ToTensor(), T.Normalize(mean, std)])
trainset = torchvision.datasets.CIFAR10(root="./data", train=True, download=True, transform=train_tf)
testset = torchvision.datasets.CIFAR10(root="./data", train=False, download=True, transform=test_tf)
trainloader = torch.utils.data.DataLoader(trainset, batch_size=512, shuffle=True, num_workers=8, pin_memory=True)
testloader = torch.utils.data.DataLoader(testset, batch_size=1024, num_workers=8)


# In[3]:


def conv_bn(c_in, c_out, pool=False):
    layers = [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True)]
    if pool:
        layers.append(nn.MaxPool2d(2))
    return nn.Sequential(*layers)


class Residual(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.res = nn.Sequential(conv_bn(c, c), conv_bn(c, c))

    def forward(self, x):
        return x + self.res(x)


class ResNet9(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.net = nn.Sequential(
            conv_bn(3, 64), conv_bn(64, 128, pool=True), Residual(128),
            conv_bn(128, 256, pool=True), conv_bn(256, 512, pool=True), Residual(512),
            nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(512, num_classes),
        )

    def forward(self, x):
        return self.net(x) * 0.125


# In[4]:


def test_accuracy(model, half_inputs=False):
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for images, labels in testloader:
            images = images.to(device)
            if half_inputs:
                images = images.half()
            outputs = model(images)
            correct += (outputs.argmax(1) == labels.to(device)).sum().item()
            total += labels.size(0)
    model.train()
    return correct / total


# In[5]:


# half the memory traffic -> should be a lot faster
net = ResNet9().to(device)
net.half()  # expect: AMP001
for m in net.modules():
    if isinstance(m, nn.BatchNorm2d):
        m.float()
criterion = nn.CrossEntropyLoss(label_smoothing=0.2)
optimizer = torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9, nesterov=True, weight_decay=5e-4)
epochs = 10
sched = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.2, epochs=epochs, steps_per_epoch=len(trainloader))


# In[6]:


t0 = time.time()
for epoch in range(epochs):
    running_loss = 0.0
    for inputs, labels in trainloader:
        inputs = inputs.to(device, non_blocking=True).half()  # expect: AMP001
        labels = labels.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        outputs = net(inputs)
        loss = criterion(outputs, labels)
        loss.backward()
        optimizer.step()
        sched.step()
        running_loss += loss.item()
    print(f"epoch {epoch} loss {running_loss / len(trainloader):.3f} ({time.time() - t0:.0f}s)")
print("test acc (half):", test_accuracy(net, half_inputs=True))


# In[7]:


# same thing with autocast for comparison
net2 = ResNet9().to(device)
optimizer2 = torch.optim.SGD(net2.parameters(), lr=0.2, momentum=0.9, nesterov=True, weight_decay=5e-4)
sched2 = torch.optim.lr_scheduler.OneCycleLR(optimizer2, max_lr=0.2, epochs=epochs, steps_per_epoch=len(trainloader))
scaler = torch.cuda.amp.GradScaler()  # expect: AMP009


# In[8]:


t0 = time.time()
for epoch in range(epochs):
    running_loss = 0.0
    for inputs, labels in trainloader:
        inputs, labels = inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        optimizer2.zero_grad(set_to_none=True)
        with torch.cuda.amp.autocast():  # expect: AMP009
            outputs = net2(inputs)
            loss = criterion(outputs, labels)
        scaler.scale(loss).backward()
        optimizer2.step()  # expect: AMP006
        scaler.update()
        sched2.step()
        running_loss += loss.item()
    print(f"epoch {epoch} loss {running_loss / len(trainloader):.3f} ({time.time() - t0:.0f}s)")
print("test acc (autocast):", test_accuracy(net2))


# In[9]:


torch.save(net2.state_dict(), "resnet9_cifar10.pt")
# Notes: half version ~2x faster per epoch, loss curve a bit noisier.
