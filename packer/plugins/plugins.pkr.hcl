# Packer >= 1.7 installs builders as plugins: `packer init packer/plugins` fetches this one.
# (Packer 1.6, Debian's package, has the amazon builder built in and cannot read this block.)
packer {
  required_version = ">= 1.7.0"
  required_plugins {
    amazon = {
      version = ">= 1.3.0"
      source  = "github.com/hashicorp/amazon"
    }
  }
}
