'''
ECAPA-TDNN speaker verification on VoxCeleb2 with AAM-softmax, mixed precision.
Model, loss and the train/eval driver in one file (adapted from a popular reimplementation).
'''

import glob
import math
import os
import sys
import time

import numpy
import soundfile
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchaudio
import tqdm
from sklearn.metrics import roc_curve
from torch.cuda.amp import GradScaler, autocast


class SEModule(nn.Module):
    def __init__(self, channels, bottleneck=128):
        super(SEModule, self).__init__()
        self.fc1 = nn.Conv1d(channels, bottleneck, kernel_size=1, padding=0)
        self.fc2 = nn.Conv1d(bottleneck, channels, kernel_size=1, padding=0)

    def forward(self, x):
        s = x.mean(dim=2, keepdim=True)  # expect: AMP004
        s = torch.sigmoid(self.fc2(F.relu(self.fc1(s))))
        return x * s


class Bottle2neck(nn.Module):
    def __init__(self, inplanes, planes, kernel_size=None, dilation=None, scale=8):
        super(Bottle2neck, self).__init__()
        width = int(math.floor(planes / scale))
        self.conv1 = nn.Conv1d(inplanes, width * scale, kernel_size=1)
        self.bn1 = nn.BatchNorm1d(width * scale)
        self.nums = scale - 1
        num_pad = math.floor(kernel_size / 2) * dilation
        self.convs = nn.ModuleList([nn.Conv1d(width, width, kernel_size=kernel_size, dilation=dilation,
                                              padding=num_pad) for _ in range(self.nums)])
        self.bns = nn.ModuleList([nn.BatchNorm1d(width) for _ in range(self.nums)])
        self.conv3 = nn.Conv1d(width * scale, planes, kernel_size=1)
        self.bn3 = nn.BatchNorm1d(planes)
        self.relu = nn.ReLU()
        self.width = width
        self.se = SEModule(planes)

    def forward(self, x):
        residual = x
        out = self.bn1(self.relu(self.conv1(x)))
        spx = torch.split(out, self.width, 1)
        for i in range(self.nums):
            sp = spx[i] if i == 0 else sp + spx[i]
            sp = self.bns[i](self.relu(self.convs[i](sp)))
            out = sp if i == 0 else torch.cat((out, sp), 1)
        out = torch.cat((out, spx[self.nums]), 1)
        out = self.bn3(self.relu(self.conv3(out)))
        out = self.se(out)
        return out + residual


class FbankAug(nn.Module):
    def __init__(self, freq_mask_width=(0, 8), time_mask_width=(0, 10)):
        super().__init__()
        self.time_mask_width = time_mask_width
        self.freq_mask_width = freq_mask_width

    def mask_along_axis(self, x, dim):
        batch, fea, time = x.shape
        D, width_range = (fea, self.freq_mask_width) if dim == 1 else (time, self.time_mask_width)
        mask_len = torch.randint(width_range[0], width_range[1], (batch, 1), device=x.device).unsqueeze(2)
        mask_pos = torch.randint(0, max(1, D - mask_len.max()), (batch, 1), device=x.device).unsqueeze(2)
        arange = torch.arange(D, device=x.device).view(1, 1, -1)
        mask = ((mask_pos <= arange) * (arange < (mask_pos + mask_len))).any(dim=1)
        mask = mask.unsqueeze(2) if dim == 1 else mask.unsqueeze(1)
        return x.masked_fill_(mask, 0.0)

    def forward(self, x):
        return self.mask_along_axis(self.mask_along_axis(x, dim=2), dim=1)


class ECAPA_TDNN(nn.Module):
    def __init__(self, C=1024):
        super(ECAPA_TDNN, self).__init__()
        self.torchfbank = torchaudio.transforms.MelSpectrogram(
            sample_rate=16000, n_fft=512, win_length=400, hop_length=160,
            f_min=20, f_max=7600, window_fn=torch.hamming_window, n_mels=80)
        self.specaug = FbankAug()
        self.conv1 = nn.Conv1d(80, C, kernel_size=5, stride=1, padding=2)
        self.relu = nn.ReLU()
        self.bn1 = nn.BatchNorm1d(C)
        self.layer1 = Bottle2neck(C, C, kernel_size=3, dilation=2, scale=8)
        self.layer2 = Bottle2neck(C, C, kernel_size=3, dilation=3, scale=8)
        self.layer3 = Bottle2neck(C, C, kernel_size=3, dilation=4, scale=8)
        self.layer4 = nn.Conv1d(3 * C, 1536, kernel_size=1)
        self.attention = nn.Sequential(
            nn.Conv1d(4608, 256, kernel_size=1), nn.ReLU(), nn.BatchNorm1d(256), nn.Tanh(),
            nn.Conv1d(256, 1536, kernel_size=1), nn.Softmax(dim=2))
        self.bn5 = nn.BatchNorm1d(3072)
        self.fc6 = nn.Linear(3072, 192)
        self.bn6 = nn.BatchNorm1d(192)

    def forward(self, x, aug):
        with torch.no_grad(), autocast(enabled=False):  # expect: AMP009
            x = self.torchfbank(x.float()) + 1e-6
            x = x.log()
            x = x - torch.mean(x, dim=-1, keepdim=True)
            if aug:
                x = self.specaug(x)
        x = self.bn1(self.relu(self.conv1(x)))
        x1 = self.layer1(x)
        x2 = self.layer2(x + x1)
        x3 = self.layer3(x + x1 + x2)
        x = self.relu(self.layer4(torch.cat((x1, x2, x3), dim=1)))
        t = x.size()[-1]
        mean_x = torch.mean(x, dim=2, keepdim=True)  # expect: AMP004
        std_x = torch.sqrt(torch.var(x, dim=2, keepdim=True).clamp(min=1e-4))  # expect: AMP004
        global_x = torch.cat((x, mean_x.repeat(1, 1, t), std_x.repeat(1, 1, t)), dim=1)
        w = self.attention(global_x)
        mu = torch.sum(x * w, dim=2)
        sg = torch.sqrt((torch.sum((x ** 2) * w, dim=2) - mu ** 2).clamp(min=1e-4))
        x = torch.cat((mu, sg), 1)
        x = self.bn6(self.fc6(self.bn5(x)))
        return x


class AAMsoftmax(nn.Module):
    def __init__(self, n_class, m, s):
        super(AAMsoftmax, self).__init__()
        self.m, self.s = m, s
        self.weight = nn.Parameter(torch.FloatTensor(n_class, 192), requires_grad=True)
        self.ce = nn.CrossEntropyLoss()
        nn.init.xavier_normal_(self.weight, gain=1)
        self.cos_m, self.sin_m = math.cos(m), math.sin(m)
        self.th = math.cos(math.pi - m)
        self.mm = math.sin(math.pi - m) * m

    def forward(self, x, label=None):
        cosine = F.linear(F.normalize(x), F.normalize(self.weight))
        sine = torch.sqrt(1.0 - cosine * cosine + 1e-8)  # expect: AMP011
        phi = cosine * self.cos_m - sine * self.sin_m
        phi = torch.where((cosine - self.th) > 0, phi, cosine - self.mm)
        one_hot = torch.zeros_like(cosine)
        one_hot.scatter_(1, label.view(-1, 1), 1)
        output = ((one_hot * phi) + ((1.0 - one_hot) * cosine)) * self.s
        loss = self.ce(output, label)
        prec1 = (output.detach().argmax(dim=1) == label).float().mean() * 100
        return loss, prec1


class ECAPAModel(nn.Module):
    def __init__(self, lr, lr_decay, C, n_class, m, s, test_step, **kwargs):
        super(ECAPAModel, self).__init__()
        self.speaker_encoder = ECAPA_TDNN(C=C).cuda()
        self.speaker_loss = AAMsoftmax(n_class=n_class, m=m, s=s).cuda()
        self.optim = torch.optim.Adam(self.parameters(), lr=lr, weight_decay=2e-5)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optim, step_size=test_step, gamma=lr_decay)
        self.scaler = GradScaler()  # expect: AMP009
        print(time.strftime("%m-%d %H:%M:%S") + " Model para number = %.2f"
              % (sum(p.numel() for p in self.speaker_encoder.parameters()) / 1024 / 1024))

    def train_network(self, epoch, loader):
        self.train()
        self.scheduler.step(epoch - 1)
        index, top1, loss = 0, 0, 0
        lr = self.optim.param_groups[0]['lr']
        for num, (data, labels) in enumerate(loader, start=1):
            self.optim.zero_grad(set_to_none=True)
            labels = torch.LongTensor(labels).cuda()
            with autocast():  # expect: AMP009
                speaker_embedding = self.speaker_encoder.forward(data.cuda(), aug=True)
                nloss, prec = self.speaker_loss.forward(speaker_embedding, labels)
                self.scaler.scale(nloss).backward()  # expect: AMP008
            self.scaler.step(self.optim)  # expect: AMP006
            index += len(labels)
            top1 += prec
            loss += nloss.detach().cpu().numpy()
            sys.stderr.write(time.strftime("%m-%d %H:%M:%S") +
                             " [%2d] Lr: %5f, Training: %.2f%%, " % (epoch, lr, 100 * (num / loader.__len__())) +
                             " Loss: %.5f, ACC: %2.2f%% \r" % (loss / num, top1 / index * len(labels)))
            sys.stderr.flush()
        sys.stdout.write("\n")
        return loss / num, lr, top1 / index * len(labels)

    def eval_network(self, eval_list, eval_path):
        self.eval()
        files, embeddings = [], {}
        lines = open(eval_list).read().splitlines()
        for line in lines:
            files.append(line.split()[1])
            files.append(line.split()[2])
        setfiles = sorted(set(files))
        for file in tqdm.tqdm(setfiles, total=len(setfiles)):
            audio, _ = soundfile.read(os.path.join(eval_path, file))
            data_1 = torch.FloatTensor(numpy.stack([audio], axis=0)).cuda()
            with torch.no_grad():
                embedding_1 = self.speaker_encoder.forward(data_1, aug=False)
                embedding_1 = F.normalize(embedding_1, p=2, dim=1)
            embeddings[file] = embedding_1
        scores, labels = [], []
        for line in lines:
            e1, e2 = embeddings[line.split()[1]], embeddings[line.split()[2]]
            scores.append(torch.mean(torch.matmul(e1, e2.T)).detach().cpu().numpy())
            labels.append(int(line.split()[0]))
        fpr, tpr, _ = roc_curve(labels, scores, pos_label=1)
        fnr = 1 - tpr
        idx = numpy.nanargmin(numpy.absolute(fnr - fpr))
        eer = max(fpr[idx], fnr[idx]) * 100
        return eer

    def save_parameters(self, path):
        torch.save(self.state_dict(), path)

    def load_parameters(self, path):
        self_state = self.state_dict()
        loaded_state = torch.load(path, map_location="cpu")
        for name, param in loaded_state.items():
            origname = name
            if name not in self_state:
                name = name.replace("module.", "")
                if name not in self_state:
                    print("%s is not in the model." % origname)
                    continue
            if self_state[name].size() != loaded_state[origname].size():
                print("Wrong parameter length: %s, model: %s, loaded: %s"
                      % (origname, self_state[name].size(), loaded_state[origname].size()))
                continue
            self_state[name].copy_(param)


def main(args, train_loader):
    model = ECAPAModel(**vars(args))
    best_eer, epoch = 1e9, 1
    score_file = open(args.score_save_path, "a+")
    while epoch <= args.max_epoch:
        loss, lr, acc = model.train_network(epoch=epoch, loader=train_loader)
        if epoch % args.test_step == 0:
            model.save_parameters(args.model_save_path + "/model_%04d.model" % epoch)
            eer = model.eval_network(eval_list=args.eval_list, eval_path=args.eval_path)
            best_eer = min(best_eer, eer)
            print(time.strftime("%Y-%m-%d %H:%M:%S"), "%d epoch, ACC %2.2f%%, EER %2.2f%%, bestEER %2.2f%%"
                  % (epoch, acc, eer, best_eer))
            score_file.write("%d epoch, LR %f, LOSS %f, ACC %2.2f%%, EER %2.2f%%, bestEER %2.2f%%\n"
                             % (epoch, lr, loss, acc, eer, best_eer))
            score_file.flush()
        epoch += 1
    score_file.close()
