# The S4 Weights train-runner image: Ubuntu 22.04 on a g6 build instance (NVIDIA L4), with the
# NVIDIA driver, a Python environment holding s4weights[gpu,s3,runner] built from this
# repository, the s4runner user and the enabled s4-runner unit. The build fails unless the GPU
# gate (packer/gate.sh) passes on the build GPU.
#
#   packer init packer/plugins     # Packer >= 1.7: fetch the amazon plugin once
#   bash packer/build.sh           # git archive of HEAD, then packer build packer/
#
# Variables: -var region=... -var instance_type=g6e.xlarge -var torch_version=...

variable "region" {
  type    = string
  default = "us-east-1"
}

variable "instance_type" {
  type        = string
  default     = "g6.xlarge"
  description = "The build instance: a g6 or g6e type, so the gate runs on the product's GPUs."
  validation {
    condition = contains([
      "g6.xlarge", "g6.2xlarge", "g6.4xlarge", "g6.8xlarge", "g6.12xlarge", "g6.16xlarge",
      "g6.24xlarge", "g6.48xlarge", "g6e.xlarge", "g6e.2xlarge", "g6e.4xlarge", "g6e.8xlarge",
      "g6e.12xlarge", "g6e.16xlarge", "g6e.24xlarge", "g6e.48xlarge",
    ], var.instance_type)
    error_message = "The build instance must be a g6.* or g6e.* type."
  }
}

variable "nvidia_driver_branch" {
  type        = string
  default     = "550-server"
  description = "Ubuntu's NVIDIA driver packages (nvidia-driver-<branch>), with CUDA 12 support."
}

variable "torch_version" {
  type        = string
  default     = "2.5.1"
  description = "torch from PyPI's default (CUDA 12) build; it brings the CUDA runtime wheels."
}

variable "ami_prefix" {
  type    = string
  default = "s4weights-train-runner"
}

locals {
  stamp = formatdate("YYYYMMDD-hhmm", timestamp())
  repo  = abspath("${path.root}/..")
}

source "amazon-ebs" "ubuntu_g6" {
  region          = var.region
  instance_type   = var.instance_type
  ami_name        = "${var.ami_prefix}-${local.stamp}"
  ami_description = "S4 Weights train runner: Ubuntu 22.04, NVIDIA driver, s4weights, GPU-gated"
  source_ami_filter {
    filters = {
      name                = "ubuntu/images/hvm-ssd/ubuntu-jammy-22.04-amd64-server-*"
      root-device-type    = "ebs"
      virtualization-type = "hvm"
    }
    owners      = ["099720109477"]
    most_recent = true
  }
  ssh_username = "ubuntu"
  # AWS Marketplace takes only unencrypted image snapshots; the stack encrypts the root volume
  # of every instance it launches.
  launch_block_device_mappings {
    device_name           = "/dev/sda1"
    volume_size           = 60
    volume_type           = "gp3"
    iops                  = 3000
    throughput            = 125
    delete_on_termination = true
  }
  tags = {
    Name      = "${var.ami_prefix}-${local.stamp}"
    s4weights = "train-runner"
    gpu_gate  = "passed"
  }
}

build {
  sources = ["source.amazon-ebs.ubuntu_g6"]

  # Only committed files go into the image: build.sh makes this archive of HEAD.
  provisioner "file" {
    source      = "${local.repo}/packer/s4weights-src.tar.gz"
    destination = "/tmp/s4weights-src.tar.gz"
  }

  provisioner "shell" {
    script            = "${path.root}/scripts/10-nvidia-driver.sh"
    environment_vars  = ["NVIDIA_DRIVER_BRANCH=${var.nvidia_driver_branch}"]
    execute_command   = "chmod +x {{ .Path }}; sudo env {{ .Vars }} {{ .Path }}"
    expect_disconnect = true
  }

  provisioner "shell" {
    script           = "${path.root}/scripts/20-python-env.sh"
    environment_vars = ["TORCH_VERSION=${var.torch_version}"]
    execute_command  = "chmod +x {{ .Path }}; sudo env {{ .Vars }} {{ .Path }}"
    pause_before     = "30s"
  }

  provisioner "shell" {
    script          = "${path.root}/scripts/30-runner.sh"
    execute_command = "chmod +x {{ .Path }}; sudo env {{ .Vars }} {{ .Path }}"
  }

  # The gate: any mismatch, or no GPU, fails the build here.
  provisioner "shell" {
    inline = ["S4_GATE_PYTHON=/opt/s4weights/venv/bin/python bash /opt/s4weights/src/packer/gate.sh --report /tmp/s4-gate.json"]
  }

  provisioner "file" {
    direction   = "download"
    source      = "/tmp/s4-gate.json"
    destination = "${local.repo}/packer/gate-report.json"
  }

  provisioner "shell" {
    script          = "${path.root}/scripts/90-cleanup.sh"
    execute_command = "chmod +x {{ .Path }}; sudo env {{ .Vars }} {{ .Path }}"
  }

  post-processor "manifest" {
    output = "${local.repo}/packer/manifest.json"
  }
}
