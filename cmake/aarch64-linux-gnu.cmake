# Cross toolchain for aarch64 Linux (Debian's gcc-aarch64-linux-gnu), with tests run under QEMU.
#   cmake --preset aarch64-dotprod   (armv8.2-a+dotprod)
#   cmake --preset aarch64-i8mm      (armv8.6-a+dotprod+i8mm)
# The architecture variant is GGML_CPU_ARM_ARCH, set by the preset (ggml adds -march=<value>).
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)

set(S3D8_CROSS_PREFIX "aarch64-linux-gnu-" CACHE STRING "cross compiler prefix")
set(CMAKE_C_COMPILER   "${S3D8_CROSS_PREFIX}gcc")
set(CMAKE_CXX_COMPILER "${S3D8_CROSS_PREFIX}g++")

set(S3D8_SYSROOT "/usr/aarch64-linux-gnu" CACHE PATH "target libraries for QEMU (-L)")
set(CMAKE_FIND_ROOT_PATH "${S3D8_SYSROOT}")
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)

# CTest runs every test executable through QEMU; `-cpu max` enables dotprod, i8mm, SVE, ...
# The presets link statically (S3D8_STATIC), so QEMU needs no -L: the tests prove the binaries are self-contained.
find_program(S3D8_QEMU qemu-aarch64)
if (S3D8_QEMU)
    if (S3D8_STATIC)
        set(CMAKE_CROSSCOMPILING_EMULATOR "${S3D8_QEMU};-cpu;max")
    else()
        set(CMAKE_CROSSCOMPILING_EMULATOR "${S3D8_QEMU};-cpu;max;-L;${S3D8_SYSROOT}")
    endif()
endif()
