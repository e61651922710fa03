# make setup (scripts/setup.sh) builds llama-cpp-python from source with this file as
# CMAKE_PROJECT_INCLUDE: read after each project() call, so after llama-cpp-python's own
# CMakeLists forced LLAMA_BUILD_COMMON on and before llama.cpp reads it. llama.cpp's `common`
# library (and the HTTP library it pulls in) is what its tools link; the Python package loads
# only libllama and libggml (its multimodal library, which would link common, is off:
# LLAVA_BUILD=OFF), and common was 60% of the build's compile time on 2 vCPUs.
set(LLAMA_BUILD_COMMON OFF CACHE BOOL "llama: build common utils library" FORCE)
