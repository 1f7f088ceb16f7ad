# Included by CMake right after llama.cpp's own project() call (CMAKE_PROJECT_llama.cpp_INCLUDE, set by
# scripts/bootstrap.sh). llama-cpp-python's CMakeLists forces LLAMA_BUILD_COMMON on (a cache FORCE that -D cannot
# override), though its Python code loads only libllama and the ggml libraries: llama-common (argument parsing,
# chat parsers, jinja, cpp-httplib) is about half of what would be compiled. A normal variable set here shadows the
# cache entry for llama.cpp's directory, so neither llama-common nor cpp-httplib is built or installed.
set(LLAMA_BUILD_COMMON OFF)
